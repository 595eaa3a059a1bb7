"""The fp32 row kernel (``quant_matmul`` of fp32 rows) for 1 to 9 rows, every weight format it
takes, against a float64 product of the dequantized weights: the row tiles (up to 8 rows, the
tails 1-7) and the output-row pairs (an odd N leaves one alone) each covered."""

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

N, K = 37, 512  # an odd number of output rows; K a whole number of K-quant super-blocks
# GGUF types and the layout each becomes: Q4_0/Q4_1 4-bit with fp16 mins, Q4_K 4-bit with fp32
# scales and mins, Q8_0 8-bit without mins, Q5_1 8-bit with mins, Q6_K 8-bit in groups of 16
GGUF_TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_1", "Q6_K"]


def _gguf_weight(qtype: str) -> QuantizedWeight:
    """A random weight of GGUF type ``qtype``: quantized by gguf, or for the K-quants (which
    gguf does not quantize) random blocks with sane fp16 super-block scales."""
    rng = np.random.default_rng(3)
    if qtype in ("Q4_K", "Q6_K"):
        size = {"Q4_K": 144, "Q6_K": 210}[qtype]
        data = rng.integers(0, 256, size=(N * K // 256, size), dtype=np.uint8)
        scale = np.array([0.0123], dtype=np.float16).view(np.uint8)
        if qtype == "Q6_K":
            data[:, 208:210] = scale
        else:
            data[:, 0:2] = scale
            data[:, 2:4] = np.array([0.0071], dtype=np.float16).view(np.uint8)
        data = data.reshape(N, -1)
    else:
        dense = rng.standard_normal((N, K)).astype(np.float32) * 0.05
        data = quantize(dense, GGMLQuantizationType[qtype])
    weight = from_gguf(data, qtype, (N, K))
    assert weight is not None
    return weight


@pytest.fixture(scope="module")
def weights() -> dict[str, QuantizedWeight]:
    """Each format the row kernel takes, by name."""
    found = {qtype: _gguf_weight(qtype) for qtype in GGUF_TYPES}
    dense = torch.randn(N, K, generator=torch.Generator().manual_seed(4)) * 0.05
    found["int4 fp32 scales"] = quantize_dense(dense, "int4")
    found["int8 fp32 scales"] = quantize_dense(dense, "int8")
    int4 = found["int4 fp32 scales"]
    found["4-bit without mins"] = QuantizedWeight(int4.qdata, int4.scales, None, 4, 32)
    return found


def _matmul(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    return quant_ops().quant_matmul(
        x, weight.qdata, weight.scales, weight.mins, weight.bits, weight.group
    )


@pytest.mark.parametrize("rows", range(1, 10))
def test_row_kernel_matches_float64_product(weights, rows):
    """Within fp32 summation error of the float64 product x @ dequant(w).T: at most (K + 4)
    roundings of 2^-24 of sum_k |x_k w_k| (a K-term sum of products of rounded weights; a wrong
    weight or a lost group would be off by about 1/K of that sum, 60 times the bound)."""
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    for name, weight in weights.items():
        w = dequantize_reference(weight).double()
        exact = x.double() @ w.T
        bound = (K + 4) * 2.0**-24 * (x.double().abs() @ w.abs().T) + 1e-30
        got = _matmul(x, weight)
        assert got.dtype == torch.float32 and got.shape == (rows, N), name
        error = (got.double() - exact).abs()
        assert (error <= bound).all(), (name, (error / bound).max().item())


def test_a_row_is_the_same_in_any_block(weights):
    """A row's result is bit-identical alone and in steps of 2 to 9 rows, at any position (the
    tiles and tails all sum in one order), on one thread or two."""
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(11))
    threads = torch.get_num_threads()
    for name, weight in weights.items():
        alone = torch.cat([_matmul(x[i : i + 1].contiguous(), weight) for i in range(9)])
        for rows in range(2, 10):
            assert torch.equal(_matmul(x[:rows], weight), alone[:rows]), (name, rows)
        try:
            torch.set_num_threads(1)
            one_thread = _matmul(x, weight)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one_thread, alone), name
