"""The Triton paged decode kernel (CUDA's decode attention) against an fp64 reference over the
same KV layout: on the CPU under Triton's interpreter, on a GPU (``CENOTE_TEST_DEVICE=cuda``)
compiled. Block sizes that are and are not powers of two, head sizes padded to one, grouped
query heads, soft-capping, windows (keys starting past position 0), rows longer than a tile."""

from __future__ import annotations

import pytest
import torch
from factories.device import TEST_DEVICE

from cenote.models.layers.attention import kv_cache_shape
from cenote.models.layers.triton_attention import TILE, triton_paged_decode

pytest.importorskip("triton")  # on the CPU, interpreted (conftest sets TRITON_INTERPRET)


def _case(
    lengths: list[int],
    starts: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Random queries and a KV cache whose blocks are handed to the rows shuffled, tables
    padded with block 0s as the plan pads them."""
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_row) + 3
    kv = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(per_row)
    tables, taken = [], 0
    for n in per_row:
        own = order[taken : taken + n]
        taken += n
        tables.append(own + [0] * (width - n))
    q = torch.randn(len(lengths), heads, head_dim, generator=gen)
    return (
        q.to(dtype),
        kv.to(dtype),
        torch.tensor(tables, dtype=torch.long),
        torch.tensor(starts, dtype=torch.long),
        torch.tensor(lengths, dtype=torch.long),
    )


def _reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """fp64, row by row: the row's keys gathered position by position from its table."""
    rows, heads, head_dim = q.shape
    _, kv_heads, _, block_size, _ = kv.shape
    group = heads // kv_heads
    out = torch.empty(rows, heads, head_dim, dtype=torch.float64)
    for r in range(rows):
        positions = torch.arange(int(starts[r]), int(ends[r]))
        blocks = tables[r, positions // block_size]
        keys = kv[0][:, blocks, positions % block_size].double()  # [kv_heads, n, dim]
        values = kv[1][:, blocks, positions % block_size].double()
        for h in range(heads):
            scores = keys[h // group] @ q[r, h].double() * scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            out[r, h] = torch.softmax(scores, dim=0) @ values[h // group]
    return out


CASES = {
    # name: (lengths, starts, heads, kv_heads, head_dim, block_size, softcap)
    "one block each": ([1, 3, 4], [0, 0, 0], 4, 4, 16, 4, 0.0),
    "across tiles, grouped heads": ([TILE * 2 + 5, 9, TILE], [0, 0, 0], 6, 2, 32, 16, 0.0),
    "block size 5, head 24 padded": ([23, 1, 11], [0, 0, 0], 3, 1, 24, 5, 0.0),
    "soft-capped": ([40, 7], [0, 0], 4, 2, 16, 8, 30.0),
    "windows": ([50, 12, 80], [30, 0, 80 - 17], 4, 2, 16, 4, 0.0),
}


def _device_tensors(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(TEST_DEVICE) for t in tensors)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_an_fp64_reference(name: str, dtype: torch.dtype) -> None:
    lengths, starts, heads, kv_heads, head_dim, block_size, softcap = CASES[name]
    case = _case(
        lengths,
        starts,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    scale = head_dim**-0.5
    op = triton_paged_decode()
    assert op is not None
    got = op(*_device_tensors(case), scale, softcap)
    expected = _reference(*case, scale, softcap)
    assert got.dtype == dtype and got.shape == case[0].shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu().double(), expected, atol=tolerance, rtol=tolerance)


def test_bf16_matches_the_reference() -> None:
    case = _case(
        [37, 2], [0, 0], heads=4, kv_heads=2, head_dim=16, block_size=8, dtype=torch.bfloat16
    )
    op = triton_paged_decode()
    assert op is not None
    got = op(*_device_tensors(case), 0.25, 0.0)
    expected = _reference(*case, 0.25, 0.0)
    # bf16 output: its own rounding (8 bits of mantissa) bounds the error
    torch.testing.assert_close(got.cpu().double(), expected, atol=1e-2, rtol=1e-2)


def test_no_rows() -> None:
    case = _case([1], [0], heads=2, kv_heads=1, head_dim=16, block_size=4, dtype=torch.float32)
    q, kv, tables, starts, ends = _device_tensors(case)
    op = triton_paged_decode()
    assert op is not None
    assert op(q[:0], kv, tables[:0], starts[:0], ends[:0], 0.25, 0.0).shape == (0, 2, 16)


def test_the_op_registration() -> None:
    """``torch.library.opcheck``: schema, fake (meta) shapes and autograd registration agree
    with what the op does."""
    case = _case(
        [9, 4], [0, 0], heads=2, kv_heads=1, head_dim=16, block_size=4, dtype=torch.float32
    )
    op = triton_paged_decode()
    assert op is not None
    torch.library.opcheck(
        torch.ops.cenote_triton.paged_decode.default, (*_device_tensors(case), 0.25, 0.0)
    )
