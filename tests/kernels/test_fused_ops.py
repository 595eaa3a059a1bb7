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


def _bf16_ties(rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual`` and ``x`` whose fp32 sums lie halfway between two bf16 values (1 + 2^-8
    rounds down to 1, 1 + 3 * 2^-8 up to 1 + 2^-6: nearest even), elsewhere random."""
    residual = torch.randn(rows, dim).to(torch.bfloat16)
    x = torch.randn(rows, dim).to(torch.bfloat16)
    residual[:, ::3] = torch.tensor([1.0, 1.0 + 2**-7]).repeat(dim)[: (dim + 2) // 3]
    x[:, ::3] = 2**-8
    return residual, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 16, 17, 70])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_rounds_as_torch(dtype, rows, with_residual):
    """Bit for bit torch's ``residual + x`` and ``weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)``,
    with the mean's sum added in column order (the kernel's order; torch's own reduction
    differs from it only by the reassociation of that sum)."""
    dim, eps = 100, 1e-5
    residual, x = _bf16_ties(rows, dim)
    residual, x = residual.to(dtype), x.to(dtype)
    weight = (torch.randn(dim) * 2).to(dtype)
    h = residual + x if with_residual else x
    squares = h.float() * h.float()
    total = torch.zeros(rows)
    for j in range(dim):
        total += squares[:, j]
    # fp32's correctly rounded sqrt and division, through fp64 (rounding twice is exact for
    # these two; torch's fp32 kernels may be off by an ulp)
    mean = total / torch.full_like(total, dim) + torch.full_like(total, eps)
    inv = (1.0 / mean.double().sqrt().float().double()).float()
    expected = weight * (h.float() * inv[:, None]).to(dtype)
    out, res = x.clone(), residual.clone() if with_residual else None
    quant_ops().add_rms_norm_(out, res, weight, eps)
    assert torch.equal(out, expected)
    if res is not None:
        assert torch.equal(res, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("head_dim", [64, 6])
def test_rotary_is_torchs_rotate_half(dtype, rows, head_dim):
    """Bit for bit ``x * cos + rotate_half(x) * sin`` on the first ``width`` columns of strided
    rows (q and k heads of a fused qkv), each product rounded to the dtype; the rest untouched."""
    heads, width = 12, 9 * head_dim
    qkv = (torch.randn(rows, heads * head_dim + 8) * 3).to(dtype)
    angles = torch.randn(rows, head_dim // 2).repeat(1, 2) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = qkv[:, :width].view(rows, -1, head_dim)
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    expected = qkv.clone()
    expected[:, :width] = (x * cos[:, None] + rotated * sin[:, None]).reshape(rows, width)
    view = qkv[:, : heads * head_dim]
    quant_ops().rotary_(view, cos, sin, width)
    assert torch.equal(qkv, expected)


def test_python_m_cenote_kernels_builds_both_extensions(capsys):
    """The set-up step of scripts/serve.sh: both extensions ready (built or cached), exit 0."""
    from cenote.kernels.__main__ import main

    assert main() == 0
    out = capsys.readouterr().out
    assert "quantized matmul / fused layers: ready" in out and "attention: ready" in out


def _argmax_cases() -> list[torch.Tensor]:
    """Rows where the first maximum is easy to get wrong: ties inside a lane and across lanes,
    NaNs in the vector part and in the tail, -inf rows, signed zeros, rows shorter than a
    vector and of lengths that are not a multiple of 16."""
    generator = torch.Generator().manual_seed(0)
    cases = [torch.randn(rows, n, generator=generator) for rows, n in [(1, 49152), (16, 1000)]]
    cases += [torch.randn(3, n, generator=generator) for n in (1, 5, 15, 16, 17, 33, 257)]
    ties = torch.randint(0, 4, (8, 300), generator=generator).float()  # many equal maxima
    ties[1, 40] = ties[1, 200] = 9.0  # the same maximum in two lanes, 40 first
    ties[2, 41] = ties[2, 25] = 9.0  # lane 9 before lane 1's later copy
    cases.append(ties)
    nans = torch.randn(6, 100, generator=generator)
    nans[0, 50] = float("nan")  # in the vector part
    nans[1, 98] = float("nan")  # in the tail (100 = 6 x 16 + 4)
    nans[2, 0] = float("nan")
    nans[3, 70] = nans[3, 20] = float("nan")  # the first one wins
    nans[4, 10] = float("inf")
    nans[4, 60] = float("nan")  # a NaN beats +inf
    cases.append(nans)
    cases.append(torch.full((2, 40), float("-inf")))  # every token masked: index 0, as torch
    zeros = torch.full((2, 40), -1.0)
    zeros[0, 7], zeros[0, 3] = 0.0, -0.0  # -0 == +0: the first of them
    zeros[1, 35], zeros[1, 30] = -0.0, 0.0
    cases.append(zeros)
    return cases


def test_argmax_rows_is_torchs_argmax():
    """The same index as ``torch.argmax(x, -1)`` on every row: the first maximum, a NaN
    counting as the maximum; non-contiguous rows too (through the sampler's wrapper)."""
    from cenote.kernels.ops import argmax

    for x in _argmax_cases():
        expected = x.argmax(dim=-1)
        assert torch.equal(quant_ops().argmax_rows(x), expected), x.shape
        assert torch.equal(argmax(x), expected)
        assert torch.equal(argmax(x.t().contiguous().t()), expected)  # column-major rows


def test_argmax_rows_refuses_bad_input():
    with pytest.raises(RuntimeError, match="fp32"):
        quant_ops().argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="fp32"):
        quant_ops().argmax_rows(torch.zeros(2, 5, dtype=torch.float64))


@pytest.mark.parametrize("dim", [384, 100, 16, 7])
def test_layer_norm_in_place_is_torchs(dim):
    """bf16 rows normalized in place: within one rounding of LayerNorm computed in fp64 (the
    moments are fp32, as torch's; only their summation order differs), rows of any width
    (masked tails), rows with a large common offset (the one-pass moments must not cancel), a
    constant row (variance 0), strided rows; the module's ``normalize_`` returns its input."""
    from cenote.models.layers.norm import LayerNorm

    generator = torch.Generator().manual_seed(dim)
    rows = torch.randn(70, dim, generator=generator) * 3
    rows[1] += 1000.0  # offset much larger than the spread
    rows[2] = 5.0  # constant: normalizes to the bias
    norm = LayerNorm(dim, eps=1e-12).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=generator))
        norm.bias.copy_(torch.randn(dim, generator=generator))
    wide = torch.zeros(70, dim + 9, dtype=torch.bfloat16)
    wide[:, :dim] = rows.to(torch.bfloat16)
    x = wide[:, :dim]  # rows with a stride past their width
    source = x.double()
    reference = torch.nn.functional.layer_norm(
        source, (dim,), norm.weight.double(), norm.bias.double(), 1e-12
    )
    with torch.inference_mode():
        out = norm.normalize_(x)
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(wide[:, dim:], torch.zeros(70, 9, dtype=torch.bfloat16))
    torch.testing.assert_close(out.double(), reference, rtol=2**-8, atol=1e-5)
    assert torch.equal(out[2], norm.bias.detach())


def test_layer_norm_falls_back_outside_bf16_rows():
    """fp32 rows (and 3-d input) go through torch's LayerNorm, out of place."""
    from cenote.models.layers.norm import LayerNorm

    norm = LayerNorm(32)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        out = norm.normalize_(x)
        assert out.data_ptr() != x.data_ptr()
        torch.testing.assert_close(
            out, torch.nn.functional.layer_norm(x, (32,), norm.weight, norm.bias)
        )
        y = torch.randn(2, 3, 32, dtype=torch.bfloat16)
        assert torch.equal(norm.to(torch.bfloat16).normalize_(y), norm(y))


def test_layer_norm_refuses_bad_input():
    ops = quant_ops()
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"weight and bias must be bf16 \[8\]"):
        ops.layer_norm_(
            x, torch.zeros(7, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16), 1e-5
        )
    with pytest.raises(RuntimeError, match="x must be bf16"):
        ops.layer_norm_(x.float(), torch.zeros(8), torch.zeros(8), 1e-5)


@pytest.mark.parametrize("dim", [384, 100, 7])
def test_add_layer_norm_normalizes_the_fp32_sum(dim):
    """``add_normalize_``: LayerNorm of x + residual, the sum kept in fp32 (not rounded to bf16),
    written over x: within one rounding of fp64 on strided rows and a residual that cancels x
    (a constant sum), residual untouched; the fallback (fp32 rows) is torch's norm of the sum."""
    from cenote.models.layers.norm import LayerNorm

    generator = torch.Generator().manual_seed(dim)
    norm = LayerNorm(dim, eps=1e-12).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=generator))
        norm.bias.copy_(torch.randn(dim, generator=generator))
    wide = torch.zeros(40, dim + 5, dtype=torch.bfloat16)
    wide[:, :dim] = (torch.randn(40, dim, generator=generator) * 3).to(torch.bfloat16)
    x = wide[:, :dim]
    residual = (torch.randn(40, dim, generator=generator) * 2 + 100).to(torch.bfloat16)
    residual[3] = -x[3] + 7.0  # x + residual is 7 everywhere (bf16 rounding aside)
    kept = residual.clone()
    total = x.double() + residual.double()  # the exact sum, as the kernel keeps it
    reference = torch.nn.functional.layer_norm(
        total, (dim,), norm.weight.double(), norm.bias.double(), 1e-12
    )
    with torch.inference_mode():
        out = norm.add_normalize_(x, residual)
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(residual, kept)
    assert torch.equal(wide[:, dim:], torch.zeros(40, 5, dtype=torch.bfloat16))
    exact = [r for r in range(40) if r != 3]  # row 3's sum is 7 +- bf16 rounding of x: skip
    torch.testing.assert_close(out[exact].double(), reference[exact], rtol=2**-8, atol=1e-5)
    fp32 = LayerNorm(dim)
    a, b = torch.randn(4, dim), torch.randn(4, dim)
    with torch.inference_mode():
        expected = torch.nn.functional.layer_norm(a + b, (dim,), fp32.weight, fp32.bias)
        torch.testing.assert_close(fp32.add_normalize_(a.clone(), b), expected)


def test_add_layer_norm_refuses_a_residual_of_another_shape():
    ops = quant_ops()
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    w = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"residual must be bf16 \[3, 8\]"):
        ops.add_layer_norm_(x, torch.zeros(2, 8, dtype=torch.bfloat16), w, w, 1e-5)
    with pytest.raises(RuntimeError, match=r"residual must be bf16 \[3, 8\]"):
        ops.add_layer_norm_(x, torch.zeros(3, 8), w, w, 1e-5)


def test_linear_add_norm_sums_in_the_norm_only_where_chosen(monkeypatch):
    """``linear_add_norm`` gives the layer's output either way (to bf16 rounding against fp64),
    and adds in the norm exactly where the layer's ``adds_residual_in_norm`` says so."""
    from cenote.models.layers.linear import TrunkLinear, linear_add_norm
    from cenote.models.layers.norm import LayerNorm

    generator = torch.Generator().manual_seed(0)
    layer = TrunkLinear(64, 32).to(torch.bfloat16)
    norm = LayerNorm(32).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 64, generator=generator) * 0.2)
        layer.bias.copy_(torch.randn(32, generator=generator))
    layer.prepack()
    x = torch.randn(50, 64, generator=generator).to(torch.bfloat16)
    residual = torch.randn(50, 32, generator=generator).to(torch.bfloat16)
    reference = torch.nn.functional.layer_norm(
        x.double() @ layer.weight.double().T + layer.bias.double() + residual.double(), (32,)
    )
    calls = []
    real = LayerNorm.add_normalize_

    def spy(self, y, r):
        calls.append(y.shape)
        return real(self, y, r)

    monkeypatch.setattr(LayerNorm, "add_normalize_", spy)
    for in_norm in (False, True):
        layer.adds_residual_in_norm = in_norm
        with torch.inference_mode():
            out = linear_add_norm(layer, x, residual.clone(), norm)
        assert len(calls) == int(in_norm)
        torch.testing.assert_close(out.double(), reference, rtol=2**-6, atol=2**-6)


def test_apply_token_bitmask_refuses_bad_input():
    """Wrong dtypes, shapes and rows outside the logits are errors naming them, not writes
    outside the tensor (its results are tested in test_structured_outputs.py)."""
    logits, words = torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32)
    rows = torch.tensor([0])
    with pytest.raises(RuntimeError, match="fp32"):
        quant_ops().apply_token_bitmask_(logits.double(), rows, words)
    with pytest.raises(RuntimeError, match="int64"):
        quant_ops().apply_token_bitmask_(logits, rows.int(), words)
    with pytest.raises(RuntimeError, match="int32"):
        quant_ops().apply_token_bitmask_(logits, torch.tensor([0, 1]), words)
    with pytest.raises(RuntimeError, match="row 2 outside"):
        quant_ops().apply_token_bitmask_(logits, torch.tensor([2]), words)
    assert quant_ops().apply_token_bitmask_(logits, rows, words).tolist() == [False]
    assert torch.isneginf(logits[0]).all() and not logits[1].any()
