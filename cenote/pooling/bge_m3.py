"""BGE-M3's lexical weights (``embed_sparse``) and ColBERT vectors (``token_embed``) over the
trunk's rows; its dense ``embed`` is the usual CLS ``EmbeddingPooler``. The formulas are
FlagEmbedding's ``BGEM3FlagModel.encode`` (see ``cenote/models/bge_m3.py``)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from cenote.pooling.interface import WHOLE_PROMPT, PoolingRequirements
from cenote.pooling.metadata import PoolingMetadata
from cenote.pooling.sparse import keep_top_k
from cenote.tasks import PoolingTask


@runtime_checkable
class LexicalColbertHeads(Protocol):
    """A trunk with BGE-M3's two extra heads (the pooler's contract)."""

    unused_token_ids: frozenset[int]

    def compute_token_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size]`` -> fp32 ``[N]`` lexical weights (ReLU'd)."""
        ...

    def compute_colbert_vectors(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size]`` -> fp32 ``[N, colbert_dim]`` (not normalized)."""
        ...


class LexicalWeightPooler(nn.Module):
    """``embed_sparse``: per prompt a ``[vocab_size]`` fp32 vector holding, for each token id of
    the prompt, the largest ``relu(sparse_linear(h))`` over its occurrences; the CLS / EOS / PAD /
    UNK ids stay zero (FlagEmbedding leaves them out, as it leaves out zero weights)."""

    def __init__(self, heads: LexicalColbertHeads, vocab_size: int) -> None:
        super().__init__()
        # the head as a bound method, not a submodule (the trunk owns it)
        self.token_weights = heads.compute_token_weights
        self.vocab_size = vocab_size
        self.unused_ids = sorted(heads.unused_token_ids)

    def get_supported_tasks(self) -> tuple[PoolingTask, ...]:
        return ("embed_sparse",)

    def requirements(self, task: PoolingTask) -> PoolingRequirements:
        return WHOLE_PROMPT  # every token's weight

    def forward(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        weights = self.token_weights(hidden)  # [num_tokens] fp32, one head call
        outputs = []
        for token_weights, token_ids, params in zip(
            torch.split(weights, metadata.prompt_lens),
            metadata.prompt_token_ids,
            metadata.pooling_params,
            strict=True,
        ):
            assert params.task == "embed_sparse", f"{params.task} reached the lexical pooler"
            ids = torch.tensor(token_ids, dtype=torch.long, device=weights.device)
            pooled = torch.zeros(self.vocab_size, dtype=torch.float32, device=weights.device)
            pooled.scatter_reduce_(0, ids, token_weights, reduce="amax")
            pooled[self.unused_ids] = 0.0
            outputs.append(keep_top_k(pooled, params.max_active_dims))
        return outputs


class ColbertVectorPooler(nn.Module):
    """``token_embed``: ``colbert_linear(h)`` of every row but the first (the CLS), each
    L2-normalized: ``[prompt_len - 1, colbert_dim]`` per prompt."""

    def __init__(self, heads: LexicalColbertHeads) -> None:
        super().__init__()
        self.colbert_vectors = heads.compute_colbert_vectors  # bound: the trunk owns the head

    def get_supported_tasks(self) -> tuple[PoolingTask, ...]:
        return ("token_embed",)

    def requirements(self, task: PoolingTask) -> PoolingRequirements:
        return WHOLE_PROMPT

    def forward(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        vectors = F.normalize(self.colbert_vectors(hidden), p=2, dim=-1)
        outputs = []
        for rows, params in zip(
            torch.split(vectors, metadata.prompt_lens), metadata.pooling_params, strict=True
        ):
            assert params.task == "token_embed", f"{params.task} reached the ColBERT pooler"
            outputs.append(rows[1:])
        return outputs
