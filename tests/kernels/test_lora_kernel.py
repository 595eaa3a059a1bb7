"""The segmented LoRA kernel (``lora_shrink_expand``, cenote/kernels/csrc/lora.cpp) against
float64 torch, and ``LoRAHost.add_lora`` through it against its torch path (issue 31).

A segment is one adapter's run of rows times one block of output columns; the shapes below
cover fused blocks (column offsets), uneven ranks, K and N off the vector width (tails), empty
runs, runs longer than a row block and a call big enough to be shared among threads. These
tests also run against the AVX2 and scalar builds (tests/kernels/test_kernel_variants.py).
"""

from __future__ import annotations

import pytest
import torch

from cenote.kernels import quant_ops
from cenote.models.layers import lora
from cenote.models.layers.lora import (
    KERNEL_MAX_RUN_ROWS,
    SMALL_RUN_ROWS,
    LoRABatch,
    LoRABlock,
    LoRAGroup,
    LoRAHost,
    LoRASegments,
    lora_context,
)

ops = quant_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the kernel library did not build here")

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}  # fp32 sums of up to 1,536 products vs float64
BF16_ULP = 2.0**-8  # one rounding of the output to bf16 (relative)


def _segments(
    rows: int,
    fan_in: int,
    fan_out: int,
    specs: list[tuple[int, int, int, int, int, float]],
    factor_dtype: torch.dtype,
    seed: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[int] | list[float]]]:
    """Random factors for segments ``(row_start, row_end, col_start, n, rank, scale)``."""
    generator = torch.Generator().manual_seed(seed)
    a, b = [], []
    for *_, n, rank, _ in specs:
        a.append((torch.randn(rank, fan_in, generator=generator) * 0.1).to(factor_dtype))
        b.append((torch.randn(n, rank, generator=generator) * 0.1).to(factor_dtype))
    columns = [list(c) for c in zip(*[(s[0], s[1], s[2], s[5]) for s in specs], strict=True)]
    return a, b, columns


def _reference(out, x, a, b, row_starts, row_ends, col_starts, scales) -> torch.Tensor:
    expected = out.double()
    for i in range(len(a)):
        r0, r1, c0 = row_starts[i], row_ends[i], col_starts[i]
        delta = (x[r0:r1].double() @ a[i].double().T) @ b[i].double().T
        expected[r0:r1, c0 : c0 + b[i].shape[0]] += scales[i] * delta
    return expected


def _t_rounding_bound(out, x, a, b, row_starts, row_ends, col_starts, scales) -> torch.Tensor:
    """What rounding t = x @ a^T to bf16 once can move each output: ``BF16_ULP`` of
    ``|scale| * |t| @ |b|^T`` on the segments whose factors are bf16 (bf16 rows take
    vdpbf16ps for both products there, t rounded between them), 0 elsewhere."""
    bound = torch.zeros(out.shape, dtype=torch.float64)
    for i in range(len(a)):
        if a[i].dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
            continue
        r0, r1, c0 = row_starts[i], row_ends[i], col_starts[i]
        t = (x[r0:r1].double() @ a[i].double().T).abs()
        bound[r0:r1, c0 : c0 + b[i].shape[0]] += (
            abs(scales[i]) * BF16_ULP * (t @ b[i].double().abs().T)
        )
    return bound


def _assert_matches_float64(out: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, **FP32_TOL)
    else:  # fp32 sums, one rounding to bf16 when added to out (and t's, where bound says)
        error = (out.double() - expected).abs()
        assert (error <= BF16_ULP * expected.abs() + bound + 1e-5).all(), error.max()


# (rows, K, N, segments): decode-like, fused q/k/v blocks with tails, and a threaded call
CASES = {
    "decode": (16, 576, 576, [(0, 4, 0, 576, 16, 1.0), (4, 9, 0, 576, 16, 0.5), (12, 16, 0, 576, 8, 2.0)]),
    "fused_tails": (
        14,
        100,
        90,
        [(0, 11, 0, 40, 4, 1.0), (0, 11, 40, 25, 3, 1.0), (0, 11, 65, 25, 5, 1.0),
         (3, 3, 0, 90, 2, 1.0), (11, 14, 7, 13, 1, -1.5)],
    ),
    "threaded": (64, 1536, 576, [(0, 30, 0, 576, 32, 1.0), (30, 64, 0, 576, 16, 0.25)]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16], ids=["wf32", "wbf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_equals_float64(case: str, factor_dtype: torch.dtype, dtype: torch.dtype) -> None:
    rows, fan_in, fan_out, specs = CASES[case]
    a, b, (row_starts, row_ends, col_starts, scales) = _segments(
        rows, fan_in, fan_out, specs, factor_dtype
    )
    x = torch.randn(rows, fan_in).to(dtype)
    out = torch.randn(rows, fan_out).to(dtype)
    call = (out, x, a, b, row_starts, row_ends, col_starts, scales)
    expected, bound = _reference(*call), _t_rounding_bound(*call)
    ops.lora_shrink_expand(*call)
    _assert_matches_float64(out, expected, bound)


# long runs of bf16 rows (prefill, embeddings): (rows, K, N, segments); K and N off the 32-pair
# and 64-column widths, runs past a row chunk (128) and off the 4-row block, an empty run, a rank
# of 1 and odd ranks (a pair's partner zero), four adapters
LONG_CASES = {
    "one_run": (600, 576, 192, [(0, 600, 0, 192, 16, 1.0)]),
    "four_adapters_tails": (
        517,
        100,
        90,
        [(0, 97, 0, 90, 16, 1.0), (97, 230, 0, 40, 7, 0.5), (97, 230, 40, 50, 1, 1.0),
         (230, 230, 0, 90, 4, 1.0), (230, 361, 3, 70, 9, -2.0), (361, 517, 0, 90, 32, 1.0)],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(LONG_CASES))
@pytest.mark.parametrize("factors", ["bf16", "fp32", "mixed"])
def test_long_bf16_runs_equal_float64(case: str, factors: str) -> None:
    """bf16 rows over long runs, the factors of every segment bf16 (vdpbf16ps where the CPU has
    it), fp32 (copies), or alternating segment by segment as routing mixes them in one step."""
    rows, fan_in, fan_out, specs = LONG_CASES[case]
    a, b, (row_starts, row_ends, col_starts, scales) = _segments(
        rows, fan_in, fan_out, specs, torch.float32, seed=1
    )
    for i in range(len(a)):
        if factors == "bf16" or (factors == "mixed" and i % 2 == 0):
            a[i], b[i] = a[i].bfloat16(), b[i].bfloat16()
    x = torch.randn(rows, fan_in).bfloat16()
    out = torch.randn(rows, fan_out).bfloat16()
    call = (out, x, a, b, row_starts, row_ends, col_starts, scales)
    expected, bound = _reference(*call), _t_rounding_bound(*call)
    ops.lora_shrink_expand(*call)
    _assert_matches_float64(out, expected, bound)


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16], ids=["wf32", "wbf16"])
def test_a_row_alone_equals_the_row_inside_a_long_run(factor_dtype: torch.dtype) -> None:
    """bf16 rows: a row's update is the same bits alone as inside a run of 301 rows (rows at a
    4-row block's tail, past a 128-row chunk, the last row)."""
    a, b, _ = _segments(301, 576, 200, [(0, 301, 0, 200, 13, 1.0)], factor_dtype)
    x = torch.randn(301, 576).bfloat16()
    base = torch.randn(301, 200).bfloat16()
    together = base.clone()
    ops.lora_shrink_expand(together, x, a, b, [0], [301], [0], [1.0])
    for row in (0, 3, 129, 256, 300):
        alone = base[row : row + 1].clone()
        ops.lora_shrink_expand(alone, x[row : row + 1].clone(), a, b, [0], [1], [0], [1.0])
        assert torch.equal(alone[0], together[row])


def test_row_results_do_not_depend_on_the_segment() -> None:
    """A row's update is the same bits whether its run has 1 row or 13 (batch invariance)."""
    a, b, _ = _segments(13, 576, 192, [(0, 13, 0, 192, 16, 1.0)], torch.float32)
    x = torch.randn(13, 576)
    together = torch.zeros(13, 192)
    ops.lora_shrink_expand(together, x, a, b, [0], [13], [0], [1.0])
    for row in (0, 5, 12):
        alone = torch.zeros(1, 192)
        ops.lora_shrink_expand(alone, x[row : row + 1].clone(), a, b, [0], [1], [0], [1.0])
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(x=c["x"][:, :10].contiguous()), r"segment 0: a must be \[rank, 10\]"),
        (lambda c: c.update(row_ends=[9]), r"segment 0: rows 0:9 are not within x's 8 rows"),
        (lambda c: c.update(col_starts=[20]), r"columns 20:52 are not within out's 48 columns"),
        (lambda c: c.update(scales=[]), r"one entry per segment; got 1, 1, 1, 1, 1, 0"),
        (lambda c: c.update(out=c["out"].half()), r"both float32 or both bfloat16"),
        (
            lambda c: c.update(b=[c["b"][0].bfloat16()]),
            r"both float32 or both bfloat16, on x's device; got Float and BFloat16",
        ),
        (lambda c: c.update(x=c["x"].t().contiguous().t()), r"x and out must be contiguous"),
        (
            lambda c: c.update(
                a=c["a"] * 2,
                b=c["b"] * 2,
                row_starts=[0, 6],
                row_ends=[8, 8],
                col_starts=[0, 10],
                scales=[1.0, 1.0],
            ),
            r"segments 0 and 1 update the same outputs \(rows 0:8 and 6:8, columns 0:32 and 10:42",
        ),
    ],
)
def test_bad_arguments_raise_clearly(change, message: str) -> None:
    call = {
        "out": torch.zeros(8, 48),
        "x": torch.randn(8, 64),
        "a": [torch.randn(4, 64)],
        "b": [torch.randn(32, 4)],
        "row_starts": [0],
        "row_ends": [8],
        "col_starts": [0],
        "scales": [1.0],
    }
    change(call)
    with pytest.raises(RuntimeError, match=message):
        ops.lora_shrink_expand(*call.values())


class _Host(LoRAHost):
    def __init__(self) -> None:
        self.init_lora()


def _host_and_batch(dtype: torch.dtype) -> tuple[_Host, LoRABatch]:
    """A fused 96-column layer (three 32-column blocks) with three adapters, as the manager
    places them (bf16 layers keep fp32 copies), and a step of runs for two of them."""
    host = _Host()
    generator = torch.Generator().manual_seed(3)
    for adapter_id in (1, 2, 3):
        blocks = []
        for start in (0, 32, 64) if adapter_id != 2 else (32,):
            a = torch.randn(8, 64, generator=generator) * 0.1
            b = torch.randn(32, 8, generator=generator) * 0.1
            small = dtype != torch.float32
            blocks.append(
                LoRABlock(
                    a.to(dtype), b.to(dtype), start, start + 32, a if small else None,
                    b if small else None,
                )
            )  # fmt: skip
        host.lora_blocks[adapter_id] = tuple(blocks)
    batch = LoRABatch((LoRAGroup(1, 0, 5), LoRAGroup(2, 7, 12), LoRAGroup(9, 12, 14)))
    return host, batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_lora_through_the_kernel_equals_its_torch_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of two adapters (one on a single block), base rows between and after, an adapter
    this layer does not carry: the kernel path equals the per-run torch matmuls."""
    host, batch = _host_and_batch(dtype)
    x = torch.randn(16, 64).to(dtype)
    base = torch.randn(16, 96).to(dtype)
    with lora_context(batch):
        fast = host.add_lora(x, base.clone())
        monkeypatch.setattr(lora, "segmented_update", lambda *args: False)
        slow = host.add_lora(x, base.clone())
    assert torch.equal(fast[5:7], base[5:7]) and torch.equal(fast[12:], base[12:])
    tolerance = FP32_TOL if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(fast.float(), slow.float(), **tolerance)
    assert not torch.equal(fast, base)


def test_runs_past_the_row_limit_keep_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run longer than ``KERNEL_MAX_RUN_ROWS`` (torch measured faster there) takes torch's
    matmuls; a step as long made of shorter runs takes the kernel."""
    calls: list[int] = []
    real = lora.segmented_update

    def counting(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(lora, "segmented_update", counting)
    host, _ = _host_and_batch(torch.float32)
    rows = KERNEL_MAX_RUN_ROWS[torch.float32] + 1
    one_run = LoRABatch((LoRAGroup(1, 0, None),))
    with lora_context(one_run):
        x = torch.randn(rows, 64)
        out = host.add_lora(x, torch.zeros(rows, 96))
    assert calls == [rows]
    assert not real(x, torch.zeros(rows, 96), one_run, host.lora_blocks)
    expected = torch.cat([x @ blk.a.T @ blk.b.T for blk in host.lora_blocks[1]], dim=1)
    torch.testing.assert_close(out, expected, **FP32_TOL)
    two_runs = LoRABatch((LoRAGroup(1, 0, rows // 2), LoRAGroup(3, rows // 2, None)))
    assert real(x, torch.zeros(rows, 96), two_runs, host.lora_blocks)


def test_long_runs_of_a_bf16_layer_hand_the_kernel_its_bf16_factors() -> None:
    """A run of a bf16 layer shorter than ``SMALL_RUN_ROWS`` takes the fp32 copies of the
    factors, a longer one in the same step the bf16 factors (each run by its own length)."""
    host, _ = _host_and_batch(torch.bfloat16)
    short = SMALL_RUN_ROWS - 1
    batch = LoRABatch((LoRAGroup(1, 0, short), LoRAGroup(3, short, None)))
    segments = LoRASegments.empty()
    segments.add_layer(batch, short + SMALL_RUN_ROWS, host.lora_blocks)
    assert [a.dtype for a in segments.a] == [torch.float32] * 3 + [torch.bfloat16] * 3
    assert [b.dtype for b in segments.b] == [torch.float32] * 3 + [torch.bfloat16] * 3
