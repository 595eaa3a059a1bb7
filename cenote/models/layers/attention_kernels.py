"""Attention's C++ ops (cenote/kernels/csrc/paged_attention.cpp and varlen_attention.cpp, part
of the one kernel library cenote.kernels builds on first use for this CPU and caches on disk): ``paged_attention`` (decode rows read their KV blocks
in place) and ``varlen_attention`` (every request of a flat stream in one call).

Where they cannot be built (no compiler, an unsupported platform) ``attention_ops()`` logs why
once and returns None; attention then loops over requests in Python and gathers KV blocks.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol, cast

import torch

from cenote.kernels import kernel_library

logger = logging.getLogger(__name__)


class AttentionOps(Protocol):
    """The attention ops of ``torch.ops.cenote`` (their schemas: cenote/kernels/csrc/
    registration.cpp)."""

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        key_starts: torch.Tensor,
        key_ends: torch.Tensor,
        scale: float,
        softcap: float,
        /,
    ) -> torch.Tensor:
        """q [rows, heads, head_dim] (fp32 or bf16, the cache's dtype); kv_cache: one layer's
        ``kv_cache_shape``; block_tables [rows, max_blocks] int64; row r attends to the keys at
        table positions [key_starts[r], key_ends[r]); softcap 0 = none; -> [rows, heads, dim]."""
        ...

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        starts: list[int],
        lengths: list[int],
        scale: float,
        causal: bool,
        alibi_slopes: torch.Tensor | None = None,
        /,
    ) -> None:
        """q/out [tokens, heads, dim], k/v [tokens, kv_heads, dim]; the request of rows
        [starts[i], starts[i] + lengths[i]) attends to its own rows (SDPA, top-left causal when
        ``causal``), written into ``out``. ``alibi_slopes`` [heads] fp32 (bidirectional only):
        score(i, j) gains ``-slope * |i - j|`` before the softmax."""
        ...

    def varlen_micro_kernels(self) -> bool:
        """Whether bf16 ``varlen_attention`` runs on oneDNN's micro-kernels here (AMX or
        AVX512-BF16, checked once on a small product), not SDPA per request."""
        ...


@functools.cache
def attention_ops() -> AttentionOps | None:
    """``torch.ops.cenote`` (the kernel library, built on first call), or None."""
    if not kernel_library():
        logger.info("attention loops over requests and gathers KV blocks instead")
        return None
    _register_fakes()
    # an op namespace resolves its ops by name at run time; AttentionOps declares the schemas
    # the library registers
    return cast(AttentionOps, torch.ops.cenote)


def _register_fakes() -> None:
    """Shape functions, so the ops can sit inside a traced or compiled graph."""

    @torch.library.register_fake("cenote::paged_attention")  # type: ignore[untyped-decorator]
    def _paged(q: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.empty_like(q)

    @torch.library.register_fake("cenote::varlen_attention")  # type: ignore[untyped-decorator]
    def _varlen(*args: object) -> None:
        return None
