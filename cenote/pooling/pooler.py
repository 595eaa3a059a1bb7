"""Pooler = method + head, per task. Pooling is a named pipeline: pool -> project -> truncate -> normalize."""

from __future__ import annotations

import torch
from torch import nn

from cenote.pooling.heads import EmbeddingHead
from cenote.pooling.metadata import PoolingMetadata
from cenote.pooling.methods import SEQUENCE_METHODS, PoolingMethod, pool_all
from cenote.tasks import PoolingTask


class EmbeddingPooler(nn.Module):
    """Serves ``embed`` (one vector per prompt) and ``token_embed`` (one vector per token)."""

    def __init__(self, method: PoolingMethod, head: EmbeddingHead, output_size: int) -> None:
        super().__init__()
        if method not in SEQUENCE_METHODS:
            raise ValueError(
                f"embedding pooling must be one of {sorted(SEQUENCE_METHODS)}, got {method!r}"
            )
        self.method = method
        self.head = head
        self.output_size = output_size  # embedding size before matryoshka truncation

    def get_supported_tasks(self) -> tuple[PoolingTask, ...]:
        return ("embed", "token_embed")

    def forward(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        """``hidden``: [num_tokens, hidden] rows of the pooled prompts -> one tensor per request."""
        tasks = [params.task for params in metadata.pooling_params]
        outputs: list[torch.Tensor | None] = [None] * metadata.num_requests
        if "embed" in tasks:
            pooled = SEQUENCE_METHODS[self.method](hidden, metadata)  # [num_requests, hidden]
            projected = self.head.project(pooled)
            for i, params in enumerate(metadata.pooling_params):
                if params.task == "embed":
                    x = self.head.truncate(projected[i], params.dimensions)
                    outputs[i] = self.head.normalize(x, params.normalize)
        if "token_embed" in tasks:
            for i, rows in enumerate(pool_all(hidden, metadata)):
                params = metadata.pooling_params[i]
                if params.task == "token_embed":
                    outputs[i] = self.head(rows, params)  # [prompt_len, dimensions]
        missing = [
            p.task for p, out in zip(metadata.pooling_params, outputs, strict=True) if out is None
        ]
        assert not missing, f"tasks {missing} reached a pooler that cannot serve them"
        return outputs
