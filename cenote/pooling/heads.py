"""Heads run after a pooling method, always in fp32: project -> truncate -> normalize."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cenote.pooling_params import PoolingParams


class DenseProjector(nn.Module):
    """sentence-transformers Dense modules in sequence: ``activation(x @ W.T + b)``."""

    def __init__(self, layers: list[tuple[nn.Linear, str | None]]) -> None:
        super().__init__()
        self.linears = nn.ModuleList(linear.float() for linear, _ in layers)
        self.activations = [activation for _, activation in layers]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear, activation in zip(self.linears, self.activations, strict=True):
            x = linear(x)
            if activation == "tanh":
                x = torch.tanh(x)
        return x


class EmbeddingHead(nn.Module):
    """Embedding head: Dense projector(s), matryoshka truncation, L2 normalization."""

    def __init__(self, projector: DenseProjector | None, default_normalize: bool) -> None:
        super().__init__()
        self.projector = projector
        self.default_normalize = default_normalize

    def forward(self, pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """``pooled``: [..., hidden] fp32 for one request -> [..., dimensions or out_features]."""
        x = self.project(pooled)
        x = self.truncate(x, params.dimensions)
        return self.normalize(x, params.normalize)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.projector is None else self.projector(x)

    @staticmethod
    def truncate(x: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        return x if dimensions is None else x[..., :dimensions]

    def normalize(self, x: torch.Tensor, normalize: bool | None) -> torch.Tensor:
        on = self.default_normalize if normalize is None else normalize
        return F.normalize(x, p=2, dim=-1) if on else x
