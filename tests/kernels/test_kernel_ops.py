"""cenote/kernels/ops.py: each op's torch fallback (forced with ``ops.use_torch()``) computes what
its C++ kernel computes, bit for bit where the kernel rounds as torch does, else within the
summation-order error named at each test."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from cenote.kernels import ops, quant_ops
from cenote.models.layers.quant import quantize_dense

pytestmark = pytest.mark.skipif(quant_ops() is None, reason="C++ kernels not buildable")

DTYPES = [torch.float32, torch.bfloat16]
BF16_STEP = 2**-7  # one bf16 rounding step, relative


def both(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``run()`` on the kernels, then on the torch fallbacks."""
    kernel = run()
    with ops.use_torch():
        fallback = run()
    return kernel, fallback


def _close(dtype: torch.dtype) -> dict[str, float]:
    """One rounding of the dtype (bf16), or fp32 summation-order error."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=BF16_STEP)


def test_use_torch_switches_every_op_and_restores_the_library() -> None:
    assert ops.kernels_built()
    with ops.use_torch():
        assert not ops.kernels_built() and ops.decode_stack(4, 2, 16) is None
        assert not ops.quant_dot_supported() and not ops.int8_supported()
        with pytest.raises(RuntimeError, match="w8a8 needs the C\\+\\+ kernels"):
            ops.int8_pack(torch.zeros(4, 32))
    assert ops.kernels_built() and ops.decode_stack(4, 2, 16) is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(dtype, with_residual) -> None:
    """The residual sum is the same add; the norm differs only by the mean's summation order."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(9, 96, generator=generator).to(dtype)
    residual = torch.randn(9, 96, generator=generator).to(dtype)
    weight = torch.randn(96, generator=generator).to(dtype)

    def run() -> torch.Tensor:
        out, res = x.clone(), residual.clone() if with_residual else None
        ops.add_rms_norm_(out, res, weight, 1e-6)
        return torch.cat([out, res]) if res is not None else out

    kernel, fallback = both(run)
    if with_residual:
        assert torch.equal(kernel[9:], fallback[9:])
    torch.testing.assert_close(kernel, fallback, **_close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_and_rotary_are_bit_identical(dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(5, 2 * 48, generator=generator) * 4).to(dtype)
    kernel, fallback = both(lambda: ops.silu_and_mul(gate_up))
    assert torch.equal(kernel, fallback)

    head_dim, width = 16, 6 * 16
    qkv = (torch.randn(5, 8 * head_dim, generator=generator) * 3).to(dtype)
    angles = torch.randn(5, head_dim // 2, generator=generator).repeat(1, 2) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def rotate() -> torch.Tensor:
        rotated = qkv.clone()
        ops.rotary_(rotated, cos, sin, width)
        return rotated

    kernel, fallback = both(rotate)
    assert torch.equal(kernel, fallback) and torch.equal(kernel[:, width:], qkv[:, width:])


def test_argmax_and_token_bitmask_are_bit_identical() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=generator)
    logits[1, 40] = logits[1, 200] = 9.0  # the first of two maxima
    logits[2, 7] = float("nan")
    kernel, fallback = both(lambda: ops.argmax(logits))
    assert torch.equal(kernel, fallback)
    assert torch.equal(ops.argmax(logits.t().contiguous().t()), fallback)  # strided rows

    words = torch.randint(-(2**31), 2**31 - 1, (3, 9), dtype=torch.int32, generator=generator)
    words[1] = 0  # a row that refuses every token; 9 words = 288 < 300 tokens

    def mask() -> torch.Tensor:
        masked = logits.clone()
        kept = ops.apply_token_bitmask_(masked, torch.tensor([4, 0, 2]), words)
        return torch.cat([masked.flatten(), kept.float()])

    kernel, fallback = both(mask)
    assert torch.equal(kernel.isnan(), fallback.isnan())
    assert torch.equal(kernel.nan_to_num(), fallback.nan_to_num())


@torch.inference_mode()
def test_layer_norms_within_one_bf16_step() -> None:
    """bf16 rows: the kernel sums the moments in its own order (one bf16 step at most)."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(7, 64, generator=generator).to(torch.bfloat16)
    residual = torch.randn(7, 64, generator=generator).to(torch.bfloat16)
    weight = torch.randn(64, generator=generator).to(torch.bfloat16)
    bias = torch.randn(64, generator=generator).to(torch.bfloat16)
    kernel, fallback = both(lambda: ops.layer_norm_(x.clone(), weight, bias, 1e-12))
    torch.testing.assert_close(kernel, fallback, atol=2e-2, rtol=BF16_STEP)
    kernel, fallback = both(
        lambda: ops.add_layer_norm_(x.clone(), residual.clone(), weight, bias, 1e-12)
    )
    # the kernel adds in fp32, the fallback rounds the sum to bf16 first
    torch.testing.assert_close(kernel, fallback, atol=4e-2, rtol=2 * BF16_STEP)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_matmuls_and_dequantize(method) -> None:
    """Dequantize: the same values. Matmuls: fp32 summation order (fused kernel), the int8 rows
    of the q8 kernel (within fp32 error of the same quantized product), bf16 dot products."""
    generator = torch.Generator().manual_seed(5)
    weight = quantize_dense(torch.randn(40, 128, generator=generator), method)
    args = (weight.qdata, weight.scales, weight.mins, weight.bits, weight.group)
    for dtype in DTYPES:
        kernel, fallback = both(lambda dtype=dtype: ops.dequantize(*args, dtype))
        assert torch.equal(kernel, fallback)
    x = torch.randn(3, 128, generator=generator)
    kernel, fallback = both(lambda: ops.quant_matmul(x, *args))
    torch.testing.assert_close(kernel, fallback, atol=1e-4, rtol=1e-5)
    kernel, fallback = both(lambda: ops.quant_matmul_q8(x, *args))
    torch.testing.assert_close(kernel, fallback, atol=1e-4, rtol=1e-5)
    if ops.quant_dot_supported():
        rows = x.to(torch.bfloat16)
        kernel, fallback = both(lambda: ops.quant_matmul_dot(rows, *args))
        torch.testing.assert_close(kernel, fallback, atol=5e-2, rtol=BF16_STEP)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_paged_attention(dtype, softcap) -> None:
    generator = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 4, 12
    cache = torch.randn(2, kv_heads, num_blocks, block_size, dim, generator=generator).to(dtype)
    tables = torch.tensor([[3, 7, 1], [0, 5, 0], [11, 2, 9]])  # padded with block 0
    starts, ends = torch.tensor([0, 2, 0]), torch.tensor([10, 7, 12])
    q = torch.randn(3, heads, dim, generator=generator).to(dtype)
    kernel, fallback = both(
        lambda: ops.paged_attention(q, cache, tables, starts, ends, dim**-0.5, softcap)
    )
    torch.testing.assert_close(kernel, fallback, **_close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,alibi", [(True, False), (False, False), (False, True)])
def test_varlen_attention(dtype, causal, alibi) -> None:
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, dim = 4, 2, 16
    lengths = [5, 5, 3, 9]
    starts = [0, 5, 10, 13]
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=generator).to(dtype)
    k = torch.randn(total, kv_heads if not alibi else heads, dim, generator=generator).to(dtype)
    v = torch.randn(k.shape, generator=generator).to(dtype)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None

    def run() -> torch.Tensor:
        out = torch.empty_like(q)
        ops.varlen_attention(q, k, v, out, starts, lengths, dim**-0.5, causal, slopes)
        return out

    kernel, fallback = both(run)
    torch.testing.assert_close(kernel, fallback, **_close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_lora_shrink_expand(dtype) -> None:
    """Two adapters' runs of rows, each over two column blocks (a fused projection), plus a
    scale: the fallback sums in fp32 and rounds once, as the kernel does."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(9, 48, generator=generator).to(dtype)
    out = torch.randn(9, 40, generator=generator).to(dtype)
    rank = 4
    a = [torch.randn(rank, 48, generator=generator) for _ in range(4)]
    b = [torch.randn(n, rank, generator=generator) for n in (24, 16, 24, 16)]
    segments = dict(
        row_starts=[0, 0, 5, 5], row_ends=[5, 5, 9, 9], col_starts=[0, 24, 0, 24],
        scales=[1.0, 1.0, 0.5, 0.5],
    )  # fmt: skip

    def run() -> torch.Tensor:
        result = out.clone()
        ops.lora_shrink_expand(result, x, a, b, **segments)
        return result

    kernel, fallback = both(run)
    assert not torch.equal(kernel, out)  # the update was added
    torch.testing.assert_close(kernel, fallback, **_close(dtype))
