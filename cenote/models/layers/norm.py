"""RMSNorm as in Hugging Face Llama (normalize in fp32, cast back, then scale) and Gemma's
(1 + weight)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``forward(x [..., dim]) -> [..., dim]`` in ``x``'s dtype; the statistics are fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: weights stored zero-centred, the scale ``1 + weight`` is applied in fp32
    before the cast back (Llama casts first)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)
