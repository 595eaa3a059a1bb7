"""Paged decode attention in Triton: the CUDA implementation of the op the C++ kernel
(``attention_kernels.cpp``) is on the CPU, reading cenote's KV layout in place.

One program per (decode row, query head): its one query against the keys at table positions
``[starts[row], ends[row])`` of the row's block table, a tile of ``TILE`` positions at a time,
each position's block looked up in the table (so any block size works), softmax online in fp32
(Gemma's soft-capping before it), the output written in the query's dtype. Sliding windows need
nothing here: the plan's ``starts`` already leave out keys a window cuts.

The kernel is the same Python on every device: on the CPU it runs under Triton's interpreter
(``TRITON_INTERPRET=1``, set before this module is imported), which is how the tests check it
without a GPU. ``paged_decode`` is registered with ``torch.library`` (``cenote_triton::
paged_decode``), so it sits in a traced or compiled graph like the C++ op.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

TILE = 32  # key positions per loop iteration of a program

PagedDecode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float],
    torch.Tensor,
]


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def triton_paged_decode() -> PagedDecode | None:
    """The registered op ``cenote_triton::paged_decode``, or None where Triton is missing."""
    try:
        from cenote.models.layers.triton_paged_decode_kernel import paged_decode_kernel
    except ImportError:
        logger.info("triton is not installed: CUDA decode gathers its KV blocks instead")
        return None

    def launch(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        key_starts: torch.Tensor,
        key_ends: torch.Tensor,
        scale: float,
        softcap: float,
    ) -> torch.Tensor:
        rows, heads, head_dim = q.shape
        _, kv_heads, _, block_size, _ = kv_cache.shape
        out = torch.empty_like(q)
        if rows == 0:
            return out
        q = q if q.stride(2) == 1 else q.contiguous()
        # the kernel takes the cache's strides; only its head dimension must be dense (a
        # layer's cache is: it is allocated whole), never copied on the decode path
        assert kv_cache.stride(4) == 1, "a KV cache's head dimension must be contiguous"
        kv = kv_cache
        paged_decode_kernel[(rows, heads)](
            q,
            kv,
            block_tables,
            key_starts,
            key_ends,
            out,
            scale,
            softcap,
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            kv.stride(1),
            kv.stride(2),
            kv.stride(3),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            GROUP=heads // kv_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=_next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
            TILE_SIZE=TILE,
            SOFTCAP=softcap > 0,
        )
        return out

    @torch.library.custom_op("cenote_triton::paged_decode", mutates_args=())
    def paged_decode(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        key_starts: torch.Tensor,
        key_ends: torch.Tensor,
        scale: float,
        softcap: float,
    ) -> torch.Tensor:
        """q [rows, heads, head_dim]; kv_cache: one layer's ``kv_cache_shape``; block_tables
        [rows, max_blocks] int64; row r attends to the keys at table positions
        [key_starts[r], key_ends[r]) (each range non-empty); softcap 0 = none; -> like q."""
        return launch(q, kv_cache, block_tables, key_starts, key_ends, scale, softcap)

    @paged_decode.register_fake
    def _(q: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.empty_like(q)

    op: PagedDecode = paged_decode
    return op
