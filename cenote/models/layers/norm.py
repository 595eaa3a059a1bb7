"""RMSNorm as in Hugging Face Llama (normalize in fp32, cast back, then scale) and Gemma's
(1 + weight); LayerNorm that normalizes bf16 rows in place on cenote's kernel."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from cenote.kernels import ops


class RMSNorm(nn.Module):
    """``forward(x [..., dim]) -> [..., dim]``: a new tensor in ``x``'s dtype (statistics in
    fp32, cast, then scaled, as Hugging Face Llama). ``forward(x, residual)`` is the pre-norm
    block's fused step: ``residual += x``, then ``x`` = the norm of the sum, both in place (``x``
    must be the caller's temporary); returns ``(x, residual)``. Both run ``ops.add_rms_norm_``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        out = x.reshape(-1, x.shape[-1]).clone(memory_format=torch.contiguous_format)
        ops.add_rms_norm_(out, None, self.weight, self.eps)  # [rows, dim]
        return out.view(x.shape)


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


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, state dict and ``forward``) with ``normalize_``: the
    same result written over its input, for trunks whose input is a temporary.

    2-d bf16 rows on the CPU run cenote's kernel (fused_ops.cpp ``layer_norm_``: moments and
    the affine step in fp32, one rounding to bf16, as torch; the moments' summation order
    differs, so results can differ from torch's by one bf16 step). Writing in place keeps the
    rows in cache between the read and the write (a faster bf16 embedding pass:
    docs/performance.md, "numbers out of code comments"). Anything else returns ``self(x)``."""

    def normalize_(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm_(x, self.weight, self.bias, self.eps)

    def add_normalize_(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``self(x + residual)`` written over ``x``; on the kernel the sum stays in fp32."""
        return ops.add_layer_norm_(x, residual, self.weight, self.bias, self.eps)

    def runs_in_place(self, x: torch.Tensor) -> bool:
        """Whether ``normalize_`` of ``x`` runs on cenote's kernel (2-d bf16 CPU rows)."""
        return ops.layer_norm_in_place(x, self.weight, self.bias)
