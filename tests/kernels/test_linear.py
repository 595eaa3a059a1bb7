"""Trunk linear layers: the oneDNN-prepacked matmul and its fused epilogues (GELU, residual add)
against plain torch, and the unfused fallbacks where a weight is not packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cenote.models.layers.linear import TrunkLinear, linear_add, linear_gelu, pack_weight

pytestmark = pytest.mark.skipif(
    pack_weight(torch.zeros(2, 2)) is None, reason="oneDNN prepacking unavailable"
)


def _layer(dtype: torch.dtype, *, packed: bool = True) -> TrunkLinear:
    torch.manual_seed(0)
    layer = TrunkLinear(64, 96).to(dtype)
    if packed:
        layer.prepack()
    return layer


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_epilogue_fp32_equals_torch(approximate):
    layer = _layer(torch.float32)
    x = torch.randn(37, 64)
    expected = F.gelu(F.linear(x, layer.weight, layer.bias), approximate=approximate)
    torch.testing.assert_close(layer.forward_gelu(x, approximate), expected, rtol=1e-6, atol=1e-6)


def test_add_epilogue_fp32_equals_torch():
    layer = _layer(torch.float32)
    x, residual = torch.randn(37, 64), torch.randn(37, 96)
    expected = residual + F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(layer.forward_add(x, residual), expected, rtol=1e-6, atol=1e-6)


def test_bf16_epilogues_round_once():
    """bf16: the epilogue acts on the fp32 accumulators and rounds once, so it is at least as
    close to the fp32 result as torch's two roundings."""
    layer = _layer(torch.bfloat16)
    x, residual = torch.randn(64, 64).bfloat16(), torch.randn(64, 96).bfloat16()
    exact_linear = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    exact_gelu, exact_add = F.gelu(exact_linear), residual.float() + exact_linear
    fused_gelu, fused_add = layer.forward_gelu(x).float(), layer.forward_add(x, residual).float()
    plain_gelu = F.gelu(layer(x)).float()
    plain_add = (residual + layer(x)).float()
    assert (fused_gelu - exact_gelu).abs().mean() <= (plain_gelu - exact_gelu).abs().mean()
    assert (fused_add - exact_add).abs().mean() <= (plain_add - exact_add).abs().mean()
    torch.testing.assert_close(fused_gelu, exact_gelu, rtol=2e-2, atol=2e-2)


def test_unpacked_and_foreign_layers_fall_back():
    """An unpacked TrunkLinear, a plain nn.Linear, a non-contiguous residual: plain torch."""
    x, residual = torch.randn(5, 64), torch.randn(96, 5).T  # residual not contiguous
    for layer in (_layer(torch.float32, packed=False), torch.nn.Linear(64, 96)):
        plain = F.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(linear_gelu(layer, x, "none"), F.gelu(plain))
        torch.testing.assert_close(linear_add(layer, x, residual), residual + plain)
    packed = _layer(torch.float32)
    expected = residual + F.linear(x, packed.weight, packed.bias)
    torch.testing.assert_close(linear_add(packed, x, residual), expected, rtol=1e-6, atol=1e-6)
