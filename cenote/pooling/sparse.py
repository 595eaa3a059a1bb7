"""Sparse (SPLADE) embeddings: one weight per vocabulary entry, most of them zero.

Per prompt, written as a named pipeline (sentence-transformers' SpladePooling, then
``max_active_dims``): masked-LM logits of every token -> log1p(relu) -> max or sum over the
tokens -> keep the k largest. The result is a dense fp32 ``[vocab_size]`` vector whose zeros are
the inactive entries (what every pooling path and the process boundary carry);
``SparseEmbeddingOutput`` reads its (token id, weight) pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from cenote.pooling.interface import WHOLE_PROMPT, PoolingRequirements
from cenote.pooling.metadata import PoolingMetadata
from cenote.tasks import PoolingTask

MlmLogitsFn = Callable[[torch.Tensor], torch.Tensor]  # [N, hidden] -> [N, vocab] fp32
SparseStrategy = Literal["max", "sum"]
SparseActivation = Literal["relu", "log1p_relu"]
_ROWS_PER_CHUNK = 128  # bounds the [rows, vocab] logits held at once (16 MB for 30k words)


def keep_top_k(weights: torch.Tensor, max_active_dims: int | None) -> torch.Tensor:
    """``weights [vocab]`` with all but the ``max_active_dims`` largest set to zero
    (sentence-transformers' ``max_active_dims``); unchanged when None."""
    if max_active_dims is None or max_active_dims >= weights.shape[0]:
        return weights
    _, top = torch.topk(weights.abs(), max_active_dims)
    kept = torch.zeros_like(weights)
    kept[top] = weights[top]
    return kept


class SparsePooler(nn.Module):
    """Serves ``embed_sparse`` from a masked-LM head (``mlm_logits``)."""

    def __init__(
        self,
        mlm_logits: MlmLogitsFn,
        strategy: SparseStrategy,
        activation: SparseActivation,
        vocab_size: int,
        default_max_active_dims: int | None = None,
    ) -> None:
        super().__init__()
        if strategy not in ("max", "sum") or activation not in ("relu", "log1p_relu"):
            raise ValueError(
                f"sparse pooling is max or sum over relu or log1p_relu, got {strategy!r} over "
                f"{activation!r}"
            )
        self.mlm_logits = mlm_logits
        self.strategy = strategy
        self.activation = activation
        self.vocab_size = vocab_size
        self.default_max_active_dims = default_max_active_dims  # the model's own top-k

    def get_supported_tasks(self) -> tuple[PoolingTask, ...]:
        return ("embed_sparse",)

    def requirements(self, task: PoolingTask) -> PoolingRequirements:
        return WHOLE_PROMPT  # every token's logits

    def forward(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        """``hidden [num_tokens, hidden]`` rows of the pooled prompts -> one ``[vocab_size]``
        vector per request, zero outside its active entries."""
        outputs = []
        for rows, params in zip(
            torch.split(hidden, metadata.prompt_lens), metadata.pooling_params, strict=True
        ):
            assert params.task == "embed_sparse", f"{params.task} reached the sparse pooler"
            # 1) logits -> activate -> pool  2) keep the top k
            weights = self.pool(rows)  # [vocab_size]
            k = params.max_active_dims or self.default_max_active_dims
            outputs.append(keep_top_k(weights, k))
        return outputs

    def pool(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [prompt_len, hidden]`` of one prompt -> ``[vocab_size]`` fp32 weights."""
        pooled = torch.zeros(self.vocab_size, dtype=torch.float32, device=rows.device)
        for chunk in torch.split(rows, _ROWS_PER_CHUNK):
            x = self.mlm_logits(chunk).relu_().log1p_()  # [rows, vocab_size]
            if self.activation == "log1p_relu":
                x = x.log1p_()
            if self.strategy == "max":
                pooled = torch.maximum(pooled, x.amax(dim=0))
            else:
                pooled += x.sum(dim=0)
        return pooled
