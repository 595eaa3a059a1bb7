"""The fused decoder-layer steps (cenote/kernels/fused_ops.cpp) against the torch code they
replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cenote.kernels import quant_ops

pytestmark = pytest.mark.skipif(quant_ops() is None, reason="C++ kernels not buildable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
def test_silu_and_mul_is_torchs_silu_times_up(dtype, rows):
    """Bit for bit ``F.silu(gate) * up`` of the fused gate/up projection's two halves."""
    ops = quant_ops()
    gate_up = (torch.randn(rows, 2 * 96) * 4).to(dtype)
    expected = F.silu(gate_up[:, :96]) * gate_up[:, 96:]
    out = ops.silu_and_mul(gate_up)
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, expected)


def test_silu_and_mul_refuses_an_odd_width():
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        quant_ops().silu_and_mul(torch.randn(2, 5))


def test_python_m_cenote_kernels_builds_both_extensions(capsys):
    """The set-up step of scripts/serve.sh: both extensions ready (built or cached), exit 0."""
    from cenote.kernels.__main__ import main

    assert main() == 0
    out = capsys.readouterr().out
    assert "quantized matmul / fused layers: ready" in out and "attention: ready" in out
