"""BGE-M3 (BAAI/bge-m3): one XLM-R trunk, three outputs, as FlagEmbedding's ``BGEM3FlagModel``
computes them from the last hidden states:

- dense (``embed``): the CLS row, L2-normalized (the trunk's usual CLS pooling);
- lexical weights (``embed_sparse``): ``relu(sparse_linear(h))`` per token, the largest weight
  of each token id kept, the CLS / EOS / PAD / UNK ids and zero weights left out;
- ColBERT vectors (``token_embed``): ``colbert_linear(h)`` of every token but the CLS (the EOS
  included), each L2-normalized.

The folder is a plain ``XLMRobertaModel`` checkpoint with ``sparse_linear.pt`` (a
``Linear(hidden, 1)`` state dict) and ``colbert_linear.pt`` (``Linear(hidden, hidden)``) beside
it; ``bge_m3_architecture`` names such a folder ``BgeM3EmbeddingModel`` (vLLM's name for it,
where the user passes it through ``hf_overrides``; here it is found from the files). The heads
run in fp32 on the trunk's rows (``cenote/pooling/bge_m3.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cenote.config import ModelConfig
from cenote.models.bert import RobertaModel
from cenote.models.checkpoint_map import Derived
from cenote.models.registry import COLBERT_HEAD_FILE, SPARSE_HEAD_FILE

# the token ids FlagEmbedding leaves out of the lexical weights (its ``unused_tokens``), and the
# XLM-R token each falls back to when the folder's tokenizer config names none
_UNUSED_SPECIALS = {
    "cls_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
}


def _load_head(path: Path, out_features: int | None, hidden_size: int) -> dict[str, torch.Tensor]:
    """A torch ``Linear`` state dict (weight and bias) with its shape checked."""
    if not path.is_file():
        raise ValueError(f"{path.parent}: a BGE-M3 folder needs {path.name}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    weight, bias = state.get("weight"), state.get("bias")
    if not isinstance(weight, torch.Tensor) or not isinstance(bias, torch.Tensor):
        raise ValueError(f"{path}: expected a Linear state dict with weight and bias")
    rows = weight.shape[0] if out_features is None else out_features
    if tuple(weight.shape) != (rows, hidden_size) or tuple(bias.shape) != (rows,):
        raise ValueError(
            f"{path}: weight {tuple(weight.shape)} / bias {tuple(bias.shape)}, expected "
            f"({rows}, {hidden_size}) / ({rows},)"
        )
    return {"weight": weight, "bias": bias}


def _head_parameters(
    module: str, path: Path, out_features: int, hidden_size: int
) -> tuple[Derived, Derived]:
    """The weight and bias of head ``module``, read from ``path`` (once) when the weights load."""
    state: dict[str, torch.Tensor] = {}

    def read(kind: str) -> Callable[[dict[str, Any]], torch.Tensor]:
        def compute(_: dict[str, Any]) -> torch.Tensor:
            if not state:
                state.update(_load_head(path, out_features, hidden_size))
            return state[kind]

        return compute

    return (
        Derived(f"{module}.weight", (), read("weight")),
        Derived(f"{module}.bias", (), read("bias")),
    )


def _special_token(tokenizer_config: dict[str, Any], key: str) -> str:
    value = tokenizer_config.get(key, _UNUSED_SPECIALS[key])
    return str(value["content"]) if isinstance(value, dict) else str(value)


def _unused_token_ids(folder: Path) -> frozenset[int]:
    """Ids of the CLS / EOS / PAD / UNK tokens named by the folder's tokenizer files."""
    from tokenizers import Tokenizer

    config: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                config.update(json.load(f))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = set()
    for key in _UNUSED_SPECIALS:
        found = tokenizer.token_to_id(_special_token(config, key))
        if found is not None:
            ids.add(found)
    return frozenset(ids)


class BgeM3Model(RobertaModel):
    """The XLM-R trunk (``forward -> [num_tokens, hidden]``) plus ``sparse_linear`` and
    ``colbert_linear`` read from the folder's ``.pt`` files by ``load_weights``."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self.folder = model_config.path
        colbert = _load_head(self.folder / COLBERT_HEAD_FILE, None, self.hidden_size)
        self.colbert_dim = int(colbert["weight"].shape[0])
        self.sparse_linear = nn.Linear(self.hidden_size, 1)
        self.colbert_linear = nn.Linear(self.hidden_size, self.colbert_dim)
        self.unused_token_ids = _unused_token_ids(self.folder)
        # the heads come from the folder's .pt files, not the checkpoint
        self.checkpoint_map = self.checkpoint_map.extended(
            derived=(
                *_head_parameters(
                    "sparse_linear", self.folder / SPARSE_HEAD_FILE, 1, self.hidden_size
                ),
                *_head_parameters(
                    "colbert_linear",
                    self.folder / COLBERT_HEAD_FILE,
                    self.colbert_dim,
                    self.hidden_size,
                ),
            )
        )

    def post_load(self) -> None:
        """The heads back in fp32 (the loader cast everything to the runtime dtype): the
        weights and vectors they produce are fp32 whatever the trunk's dtype."""
        self.sparse_linear.float()
        self.colbert_linear.float()

    def compute_token_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.sparse_linear(hidden.float())).squeeze(-1)  # [N]

    def compute_colbert_vectors(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.colbert_linear(hidden.float())  # [N, colbert_dim]
