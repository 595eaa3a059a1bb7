"""Tiny JinaBERT folders (jina-embeddings-v2 / jina-reranker-v1 as the Hub ships them) and the
reference they are checked against.

transformers has no JinaBERT and the remote code (jinaai/jina-bert-implementation) cannot be
fetched offline, so ``JinaBertReference`` reconstructs its math, written apart from cenote's
model and in the remote code's own shape: padded batches with an attention mask, separate
query / key / value projections, the ALiBi tensor built for the whole padded length (slopes per
ALiBi's paper, as the remote code and text-embeddings-inference's ``alibi.rs`` compute them),
BERT's post-norm attention block and the gated MLP ``layernorm(x + wo(act(gated[:, :I]) *
gated[:, I:]))``. Its state-dict names are the checkpoint's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from .seeded import perturb
from .vocab import RETRIEVAL_BERT_SPECIALS, VOCAB_SIZE, write_retrieval_tokenizer

JINA_BERT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=8192,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    pad_token_id=0,
    hidden_act="gelu",
    feed_forward_type="geglu",
    position_embedding_type="alibi",
    emb_pooler="mean",
    model_type="bert",
    attention_probs_dropout_prob=0.0,
    hidden_dropout_prob=0.0,
)
_AUTO_MAP = {
    "AutoConfig": "jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig",
    "AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel",
    "AutoModelForMaskedLM": "jinaai/jina-bert-implementation--modeling_bert.JinaBertForMaskedLM",
    "AutoModelForSequenceClassification": (
        "jinaai/jina-bert-implementation--modeling_bert.JinaBertForSequenceClassification"
    ),
}


def reference_slopes(heads: int) -> list[float]:
    """ALiBi head slopes: for 2^k heads the geometric sequence starting at 2^(-8/heads) with
    that ratio; otherwise those of the closest lower power of two, then the even-indexed slopes
    of twice that power."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if (heads & (heads - 1)) == 0:
        return power_of_two(heads)
    closest = 2 ** int(math.floor(math.log2(heads)))
    extra = [s for i, s in enumerate(power_of_two(2 * closest)) if i % 2 == 0]
    return power_of_two(closest) + extra[: heads - closest]


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.self = nn.ModuleDict(
            {name: nn.Linear(hidden, hidden) for name in ("query", "key", "value")}
        )
        self.output = nn.ModuleDict(
            {"dense": nn.Linear(hidden, hidden), "LayerNorm": nn.LayerNorm(hidden, eps=eps)}
        )

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        head_dim = hidden // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:  # [batch, heads, length, head_dim]
            return t.view(batch, length, self.heads, head_dim).permute(0, 2, 1, 3)

        q, k, v = (split(self.self[name](x)) for name in ("query", "key", "value"))
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + bias
        context = scores.softmax(-1) @ v  # [batch, heads, length, head_dim]
        context = context.permute(0, 2, 1, 3).reshape(batch, length, hidden)
        return self.output["LayerNorm"](self.output["dense"](context) + x)


class _GatedMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, eps: float, activation: str) -> None:
        super().__init__()
        self.inner = inner
        self.gated_layers = nn.Linear(hidden, 2 * inner, bias=False)
        self.wo = nn.Linear(inner, hidden)
        self.layernorm = nn.LayerNorm(hidden, eps=eps)
        self.act = nn.GELU() if activation == "geglu" else nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.gated_layers(x)
        gated, non_gated = projected[..., : self.inner], projected[..., self.inner :]
        return self.layernorm(self.wo(self.act(gated) * non_gated) + x)


class _Layer(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["layer_norm_eps"]
        self.attention = _Attention(hidden, config["num_attention_heads"], eps)
        self.mlp = _GatedMLP(hidden, config["intermediate_size"], eps, config["feed_forward_type"])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attention(x, bias))


class JinaBertReference(nn.Module):
    """``forward(input_ids [B, L], attention_mask [B, L], token_type_ids) -> [B, L, hidden]``;
    with ``num_labels``, also ``classify`` (pooler dense + tanh on CLS, then classifier)."""

    def __init__(self, config: dict[str, Any], num_labels: int | None = None) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.config = config
        self.embeddings = nn.ModuleDict(
            {
                "word_embeddings": nn.Embedding(config["vocab_size"], hidden),
                "token_type_embeddings": nn.Embedding(config["type_vocab_size"], hidden),
                "LayerNorm": nn.LayerNorm(hidden, eps=config["layer_norm_eps"]),
            }
        )
        self.encoder = nn.ModuleDict(
            {"layer": nn.ModuleList(_Layer(config) for _ in range(config["num_hidden_layers"]))}
        )
        if num_labels is not None:
            self.pooler = nn.ModuleDict({"dense": nn.Linear(hidden, hidden)})
            self.classifier = nn.Linear(hidden, num_labels)

    def alibi(self, length: int) -> torch.Tensor:
        """[1, heads, length, length]: -slope * |key - query|."""
        positions = torch.arange(length)
        distance = (positions[None, :] - positions[:, None]).abs().float()
        slopes = -torch.tensor(reference_slopes(self.config["num_attention_heads"]))
        return (slopes[:, None, None] * distance[None]).unsqueeze(0)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings["word_embeddings"](input_ids)
        x = self.embeddings["LayerNorm"](
            x + self.embeddings["token_type_embeddings"](token_type_ids)
        )
        padding = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        bias = self.alibi(input_ids.shape[1]) + padding  # [B, heads, L, L]
        for layer in self.encoder["layer"]:
            x = layer(x, bias)
        return x

    def classify(self, input_ids: torch.Tensor) -> torch.Tensor:
        cls = self(input_ids)[:, 0]
        return self.classifier(torch.tanh(self.pooler["dense"](cls)))


def make_jina_bert(
    folder: Path,
    seed: int = 0,
    num_labels: int | None = None,
    architecture: str | None = None,
    **overrides: Any,
) -> JinaBertReference:
    """Save a seeded random JinaBERT (a reranker with ``num_labels``) as the Hub's folders hold
    it, with a mean-pooling sentence-transformers folder around a trunk; returns the reference."""
    config = {**JINA_BERT, **overrides}
    torch.manual_seed(seed)
    reference = perturb(JinaBertReference(config, num_labels), seed)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in reference.state_dict().items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if num_labels is None:
        architecture = architecture or "JinaBertForMaskedLM"
        labels = {}
    else:
        architecture = architecture or "JinaBertForSequenceClassification"
        labels = {"id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)}}
    hub = {**config, **labels, "architectures": [architecture], "auto_map": _AUTO_MAP}
    (folder / "config.json").write_text(json.dumps(hub))
    write_retrieval_tokenizer(folder, RETRIEVAL_BERT_SPECIALS, token_types=True)
    if num_labels is None:
        _write_mean_pooling(folder, config["hidden_size"])
    return reference


def _write_mean_pooling(folder: Path, hidden: int) -> None:
    """sentence-transformers metadata as jina-embeddings-v2's folders carry it: Transformer,
    then mean Pooling."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 8192, "do_lower_case": False})
    )
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' mean pooling over a padded batch."""
    weights = attention_mask.unsqueeze(-1).float()
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a, b, dim=-1)
