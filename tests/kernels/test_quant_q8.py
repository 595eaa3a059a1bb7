"""The 8-bit-activation row kernel (``quant_matmul_q8``, q8_linear.cpp) against the same
arithmetic in float64 torch: each activation row quantized to int8 per block of 32 with one fp32
scale (GGUF Q8_0: amax / 127, round half away from zero), the integer dot products scaled per
group; and against the dense product within what the activation rounding allows. Run by
tests/kernels/test_kernel_variants.py for the AVX2 (vpmaddubsw) and scalar builds too; the native build
here runs the AVX512-VNNI (vpdpbusd) path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cenote.kernels import quant_ops
from cenote.models.layers.quant import (
    QuantizedWeight,
    dequantize_reference,
    from_gguf,
    quantize_dense,
)

pytestmark = pytest.mark.skipif(quant_ops() is None, reason="quantized kernel not buildable")


def _weights(n: int = 40, k: int = 576) -> dict[str, QuantizedWeight]:
    """Each layout the kernel takes: GGUF's Q4_0 (min = -8 d), Q4_1 and Q8_0 bytes, int4
    with fp16 scales and mins, int8 with fp32 scales."""
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.1
    weights = {
        qtype: from_gguf(quantize(dense.numpy(), GGMLQuantizationType[qtype]), qtype, (n, k))
        for qtype in ("Q4_0", "Q4_1", "Q8_0")
    }
    int4 = quantize_dense(dense, "int4")
    assert int4.mins is not None
    weights["int4-fp16"] = QuantizedWeight(int4.qdata, int4.scales.half(), int4.mins.half(), 4, 32)
    weights["int8"] = quantize_dense(dense, "int8")
    return {name: weight for name, weight in weights.items() if weight is not None}


WEIGHTS = _weights()


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """xq [M, groups, 32] (as float64) and dx [M, groups], in fp32 as the kernel computes."""
    blocks = x.float().view(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    v = blocks * inv.unsqueeze(-1)
    xq = torch.sign(v) * torch.floor(v.abs() + 0.5)  # half away from zero
    return xq.double(), dx.double()


def _reference(x: torch.Tensor, weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's product in float64, and the sum of its terms' magnitudes (its scale)."""
    xq, dx = _quantize_rows(x)
    n, k = weight.shape
    w = dequantize_reference(weight).double().view(n, k // 32, 32)
    exact = torch.einsum("mgj,ngj,mg->mn", xq, w, dx)
    magnitude = torch.einsum("mgj,ngj,mg->mn", xq.abs(), w.abs(), dx)
    return exact, magnitude


def _run(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    return quant_ops().quant_matmul_q8(
        x, weight.qdata, weight.scales, weight.mins, weight.bits, weight.group
    )


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
def test_q8_kernel_is_the_quantized_product(name, rows):
    """fp32 rows: the float64 product of the same int8 rows, within fp32 summation error
    (2e-6 of the terms' magnitude); and the dense product within half an activation step per
    element (|x - dx xq| <= dx / 2)."""
    weight = WEIGHTS[name]
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    got = _run(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, weight.shape[0])
    exact, magnitude = _reference(x, weight)
    assert ((got.double() - exact).abs() <= 2e-6 * magnitude + 1e-9).all()
    _, dx = _quantize_rows(x)
    dense = dequantize_reference(weight).double()
    n, k = weight.shape
    half_step = torch.einsum("mg,ng->mn", dx / 2, dense.abs().view(n, k // 32, 32).sum(-1))
    error = (got.double() - x.double() @ dense.T).abs()
    assert (error <= half_step * 1.0001 + 2e-6 * magnitude).all()


def test_q8_kernel_takes_bf16_rows_and_rounds_once():
    """bf16 rows in, bf16 out: the fp32 kernel's result of the same rows rounded once."""
    weight = WEIGHTS["Q4_1"]
    x = torch.randn(5, weight.shape[1]).bfloat16()
    got = _run(x, weight)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _run(x.float(), weight).bfloat16())


def test_q8_rows_do_not_depend_on_the_batch():
    """Each row is quantized on its own and summed in the same order whatever its neighbours:
    bit-identical alone and in a batch of 8."""
    for weight in WEIGHTS.values():
        x = torch.randn(8, weight.shape[1])
        batch = _run(x, weight)
        for i in range(8):
            assert torch.equal(_run(x[i : i + 1], weight), batch[i : i + 1])


def test_q8_zero_and_extreme_rows():
    """A row of zeros gives zeros (scale 0, no division by it); a row with one huge value keeps
    it exactly (it becomes +-127 times its scale)."""
    weight = WEIGHTS["Q8_0"]
    x = torch.zeros(2, weight.shape[1])
    x[1, 5] = 3.0e4
    got = _run(x, weight)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    dense = dequantize_reference(weight)
    torch.testing.assert_close(got[1], 3.0e4 * dense[:, 5], rtol=1e-6, atol=0)


def test_q8_kernel_refuses_what_it_does_not_take():
    weight = WEIGHTS["Q4_0"]
    args = (weight.qdata, weight.scales, weight.mins, weight.bits, weight.group)
    k = weight.shape[1]
    with pytest.raises(RuntimeError, match="at most 8 rows, got 9"):
        quant_ops().quant_matmul_q8(torch.randn(9, k), *args)
    with pytest.raises(RuntimeError, match="groups of 32, got 16"):
        quant_ops().quant_matmul_q8(torch.randn(1, k), *args[:-1], 16)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        quant_ops().quant_matmul_q8(torch.randn(1, k).double(), *args)
    with pytest.raises(RuntimeError, match="qdata must be"):
        quant_ops().quant_matmul_q8(torch.randn(1, k + 32), *args)
    assert quant_ops().quant_matmul_q8(torch.randn(0, k), *args).shape == (0, 40)


def test_gguf_q8_0_activation_rounding_is_llama_cpps():
    """The activation blocks are GGUF Q8_0's: quantizing a row with gguf's own Q8_0 quantizer
    (fp16 scales) and dequantizing gives the rows the kernel multiplies, to fp16 scale rounding."""
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5))
    xq, dx = _quantize_rows(x)
    ours = (xq * dx.unsqueeze(-1)).view(1, -1)
    from gguf.quants import dequantize

    blocks = quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    theirs = np.asarray(dequantize(blocks, GGMLQuantizationType.Q8_0), dtype=np.float64)
    torch.testing.assert_close(ours, torch.from_numpy(theirs).view(1, -1), rtol=2e-3, atol=0)
