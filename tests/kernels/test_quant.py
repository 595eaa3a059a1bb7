"""Weight-only quantized weights: exact GGUF conversion, the kernel against plain torch, and the
models that use them (SmolLM2's GGUF kept quantized, MiniLM with int8/int4 opt-in)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from cenote.kernels import ops, quant_ops
from cenote.models.layers import quant
from cenote.models.layers.quant import (
    DENSE_ABOVE_ROWS,
    DOT_MAX_ROWS,
    DOT_MAX_ROWS_WITH_COPY,
    FUSED_MAX_ROWS,
    QuantizedWeight,
    QuantLinear,
    cat_rows,
    dequantize_reference,
    from_gguf,
    keep_dense_copies,
    quant_linear,
    quantize_dense,
    use_dot_products,
)

pytestmark = pytest.mark.skipif(quant_ops() is None, reason="quantized kernel not buildable")

_SIMPLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
_K_QUANTS = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per block of 256


def _k_quant_blocks(qtype: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of a K-quant with sane fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    size = _K_QUANTS[qtype]
    blocks = rng.integers(0, 256, size=(rows * k // 256, size), dtype=np.uint8)
    scale = np.array([0.0123], dtype=np.float16).view(np.uint8)
    if qtype == "Q6_K":
        blocks[:, 208:210] = scale
    else:
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = np.array([0.0071], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _reference(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    values = dequantize(data, GGMLQuantizationType[qtype])
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))


@pytest.mark.parametrize("qtype", _SIMPLE + list(_K_QUANTS))
def test_gguf_tensors_convert_exactly(qtype):
    """Every value the kernel reconstructs is the value gguf's own dequantize gives."""
    shape = (48, 512)
    if qtype in _K_QUANTS:
        data = _k_quant_blocks(qtype, *shape)
    else:
        w = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        data = quantize(w, GGMLQuantizationType[qtype])
    weight = from_gguf(data, qtype, shape)
    assert weight is not None
    expected = _reference(data, qtype, shape)
    assert torch.equal(dequantize_reference(weight), expected)
    assert torch.equal(weight.dequantize(torch.float32), expected)
    assert torch.equal(weight.dequantize(torch.bfloat16), expected.bfloat16())
    assert weight.nbytes < expected.nbytes / 3


def test_dense_gguf_types_stay_dense():
    assert from_gguf(np.zeros((4, 32), np.float32), "F32", (4, 32)) is None


def _weights() -> list[QuantizedWeight]:
    dense = torch.randn(40, 256) * 0.1
    half = quantize_dense(dense, "int4")
    half = QuantizedWeight(half.qdata, half.scales.half(), half.mins.half(), 4, 32)
    q6k = from_gguf(_k_quant_blocks("Q6_K", 40, 256), "Q6_K", (40, 256))  # int8, groups of 16
    return [quantize_dense(dense, "int8"), quantize_dense(dense, "int4"), half, q6k]


def _assert_matmul_close(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """fp32 agreement up to summation order: |error| <= 2e-6 * sum_k |x_k w_k| (about
    sqrt(K) float32 ulps of the terms' magnitude)."""
    bound = 2e-6 * (x.abs() @ dense.abs().T) + 1e-7
    error = (got - x @ dense.T).abs()
    assert (error <= bound).all(), (error / bound).max()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1, 37])
def test_quant_linear_matches_dense_matmul(rows):
    """Fused kernel (few rows) and dequantize + matmul (many) agree with x @ W.T in fp32."""
    ops = quant_ops()
    for weight in _weights():
        x = torch.randn(rows, 256)
        dense = dequantize_reference(weight)
        bias = torch.randn(40)
        _assert_matmul_close(quant_linear(x, weight, bias) - bias, x, dense)
        fused = ops.quant_matmul(
            x, weight.qdata, weight.scales, weight.mins, weight.bits, weight.group
        )
        _assert_matmul_close(fused, x, dense)


_dot_runs = quant_ops() is not None and quant_ops().quant_dot_supported()
needs_dot = pytest.mark.skipif(
    not _dot_runs, reason="no AVX512-BF16 dot products (the refusal is tested below)"
)


def _assert_bf16_dot_close(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> None:
    """bf16 rows times the bf16 rounding of the dequantized weight (what a dense bf16 copy
    holds), exact products summed in fp32, the sum rounded once to bf16: within half a bf16
    step (2^-8 relative) of the float64 product, plus fp32 summation error."""
    w = dequantize_reference(weight).bfloat16().double()
    exact = x.double() @ w.T
    bound = 2.0**-8 * exact.abs() + 4e-6 * (x.double().abs() @ w.abs().T) + 1e-30
    error = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16 and (error <= bound).all(), (error / bound).max()


@needs_dot
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 17, 64])
def test_dot_kernel_matches_the_bf16_copy_product(rows):
    """quant_matmul_dot: w4 with fp32 or fp16 scales and mins, w8 without mins, and a weight
    whose 37 rows leave a partial block of 4 output columns."""
    ops = quant_ops()
    tail = quantize_dense(torch.randn(37, 256) * 0.1, "int4")
    for weight in [*_weights()[:3], tail]:
        x = (torch.randn(rows, 256) * 2).bfloat16()
        args = (weight.qdata, weight.scales, weight.mins, weight.bits, weight.group)
        got = ops.quant_matmul_dot(x, *args)
        assert got.shape == (rows, weight.shape[0])
        _assert_bf16_dot_close(got, x, weight)
        # each row's result is the same alone as among the others
        assert torch.equal(ops.quant_matmul_dot(x[-1:].contiguous(), *args), got[-1:])


def test_dot_kernel_refuses_what_it_does_not_take():
    ops = quant_ops()
    weight = quantize_dense(torch.randn(8, 64), "int4")
    args = (weight.qdata, weight.scales, weight.mins, weight.bits, weight.group)
    if not ops.quant_dot_supported():
        with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
            ops.quant_matmul_dot(torch.randn(2, 64).bfloat16(), *args)
        return
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        ops.quant_matmul_dot(torch.randn(2, 64), *args)
    q6k = _weights()[3]  # int8, groups of 16
    with pytest.raises(RuntimeError, match="groups of 32, got 16"):
        ops.quant_matmul_dot(torch.randn(2, 256).bfloat16(), q6k.qdata, q6k.scales, q6k.mins, 8, 16)
    with pytest.raises(RuntimeError, match="K=32 is not|columns for K=32"):
        ops.quant_matmul_dot(torch.randn(2, 32).bfloat16(), *args)


@needs_dot
def test_bf16_layers_route_rows_to_the_dot_kernel():
    """A bf16 4-bit layer with dot products: up to DENSE_ABOVE_ROWS[bf16] rows the fused kernel,
    then quant_matmul_dot up to DOT_MAX_ROWS, then dequantize + matmul; with a dense copy kept,
    the dot kernel only up to DOT_MAX_ROWS_WITH_COPY (8-bit layers: not at all), then the
    copy. Not in fp32 models."""
    ops = quant_ops()
    weight = quantize_dense(torch.randn(96, 256), "int4")
    args = (weight.qdata, weight.scales, weight.mins, weight.bits, weight.group)
    layer = QuantLinear([weight], None)
    int8_layer = QuantLinear([quantize_dense(torch.randn(96, 256), "int8")], None)
    model = torch.nn.Sequential(layer, int8_layer)
    assert use_dot_products(model, torch.float32) == 0
    assert use_dot_products(model, torch.bfloat16) == 2
    assert (layer.dot_max_rows, int8_layer.dot_max_rows) == (DOT_MAX_ROWS, DOT_MAX_ROWS)
    int8_layer.keep_dense(torch.bfloat16)  # 8-bit: the copy from 5 rows on
    assert int8_layer.dot_max_rows == 0
    few = DENSE_ABOVE_ROWS[torch.bfloat16]
    x = torch.randn(DOT_MAX_ROWS + 1, 256).bfloat16()
    assert torch.equal(layer(x[:few]), ops.quant_matmul(x[:few], *args))
    for rows in (few + 1, DOT_MAX_ROWS):
        assert torch.equal(layer(x[:rows]), ops.quant_matmul_dot(x[:rows], *args))
    dense = weight.dequantize(torch.bfloat16)
    assert torch.equal(layer(x), torch.mm(x, dense.t()))
    layer.keep_dense(torch.bfloat16)
    assert layer.dot_max_rows == DOT_MAX_ROWS_WITH_COPY
    rows = DOT_MAX_ROWS_WITH_COPY
    assert torch.equal(layer(x[:rows]), ops.quant_matmul_dot(x[:rows], *args))
    _assert_bf16_dot_close(layer(x[: rows + 1]), x[: rows + 1].float(), weight)


def test_quant_linear_bf16_activations():
    weight = quantize_dense(torch.randn(64, 128), "int4")
    x = torch.randn(3, 128).bfloat16()
    out = quant_linear(x, weight, None)
    assert out.dtype == torch.bfloat16
    expected = x.float() @ dequantize_reference(weight).T
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def _assert_bf16_rounding_of_exact(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """The fp32-summed product rounded once to bf16: within half a bf16 step (at most 2^-8
    relative) of the float64 product of the bf16 rows and the exact dequantized weight, plus
    fp32 summation error."""
    exact = x.double() @ dense.double().T
    bound = 2.0**-8 * exact.abs() + 4e-6 * (x.double().abs() @ dense.double().abs().T) + 1e-30
    error = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16 and (error <= bound).all(), (error / bound).max()


def test_fused_kernel_takes_bf16_rows_and_rounds_once():
    """bf16 rows in, bf16 out, rounded once: for 8-bit weights (and 4-bit ones without bf16
    dot products) bit for bit the fp32 kernel on the widened rows, rounded by torch's cast; for
    4-bit weights on AVX512-BF16 the bf16 row kernel (the same exact products, summed in
    another order), within half a bf16 step of the exact product. The decode stack's
    projections call it so, without conversions around it."""
    ops = quant_ops()
    for weight in _weights():
        x = (torch.randn(5, 256) * 3).bfloat16()
        args = (weight.qdata, weight.scales, weight.mins, weight.bits, weight.group)
        got = ops.quant_matmul(x, *args)
        assert got.dtype == torch.bfloat16 and got.shape == (5, weight.shape[0])
        if weight.bits == 4 and _dot_runs:
            _assert_bf16_rounding_of_exact(got, x, dequantize_reference(weight))
        else:
            assert torch.equal(got, ops.quant_matmul(x.float(), *args).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.quant_matmul(x.t().contiguous().t(), *args)


@needs_dot
@pytest.mark.parametrize("k", [64, 96, 576, 1536])
def test_bf16_row_kernel_for_4_bit_weights(k):
    """quant_matmul of bf16 rows and 4-bit weights on AVX512-BF16 (each nibble q as the bf16
    number 16 + q): fp16 or fp32 scales, with and without mins, an odd number of groups (96),
    output rows outside full blocks of 4 (37), 1 to 9 activation rows. Each row is bit for bit
    the same row multiplied alone, and the result the same on 1 thread as on 2."""
    ops = quant_ops()
    fp32 = quantize_dense(torch.randn(37, k) * 0.05, "int4")
    fp16 = QuantizedWeight(fp32.qdata, fp32.scales.half(), fp32.mins.half(), 4, 32)
    symmetric = QuantizedWeight(fp32.qdata, fp32.scales, None, 4, 32)
    for weight in (fp32, fp16, symmetric):
        args = (weight.qdata, weight.scales, weight.mins, 4, 32)
        reference = dequantize_reference(weight)
        for rows in (1, 2, 3, 4, 5, 9):
            x = (torch.randn(rows, k) * 3).bfloat16()
            got = ops.quant_matmul(x, *args)
            _assert_bf16_rounding_of_exact(got, x, reference)
            for i in range(rows):
                alone = ops.quant_matmul(x[i : i + 1].contiguous(), *args)
                assert torch.equal(alone, got[i : i + 1])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one_thread = ops.quant_matmul(x, *args)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one_thread, got)


def test_row_results_do_not_depend_on_the_batch():
    """A row's output is the same alone or among others (fused kernel rows are independent)."""
    weight = quantize_dense(torch.randn(96, 256), "int4")
    x = torch.randn(FUSED_MAX_ROWS, 256)
    together = quant_linear(x, weight, None)
    for i in range(x.shape[0]):
        assert torch.equal(quant_linear(x[i : i + 1], weight, None)[0], together[i])


def test_fused_projection_of_mixed_formats():
    """q/k/v shards in different formats stay separate blocks, outputs concatenated in order."""
    dense = [torch.randn(32, 64), torch.randn(16, 64)]
    parts = [quantize_dense(dense[0], "int4"), quantize_dense(dense[1], "int8")]
    assert cat_rows(parts) is None
    layer = QuantLinear(parts, None)
    x = torch.randn(2, 64)
    expected = torch.cat([x @ dequantize_reference(p).T for p in parts], dim=-1)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_copy_serves_steps_of_many_rows(dtype):
    """With ``keep_dense`` a layer multiplies more than DENSE_ABOVE_ROWS[dtype] rows by its
    dense copy (x @ W.T of the dequantized weight); fewer rows still take the fused kernel."""
    weight = quantize_dense(torch.randn(96, 256), "int4")
    bias = torch.randn(96).to(dtype)
    layer = QuantLinear([weight], bias)
    few = DENSE_ABOVE_ROWS[dtype]
    x = torch.randn(few + 3, 256).to(dtype)
    fused_few = layer(x[:few])
    assert layer.keep_dense(dtype) == 96 * 256 * dtype.itemsize
    assert torch.equal(layer(x[:few]), fused_few)
    got = layer(x)
    assert got.dtype == dtype
    dense = dequantize_reference(weight)
    if dtype == torch.float32:
        _assert_matmul_close(got - bias, x, dense)
    else:  # the copy is the bf16 rounding of the dequantized weight
        expected = x.float() @ dense.bfloat16().float().T + bias.float()
        torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_dense_copies_follow_the_option(monkeypatch):
    """on: every QuantLinear gets a copy; off: none; auto: only within a quarter of the
    available memory."""
    weights = [quantize_dense(torch.randn(64, 128), "int8") for _ in range(2)]

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(*(QuantLinear([w], None) for w in weights))

    need = 2 * 64 * 128 * 4
    for mode, available, kept in (
        ("on", 0, need),
        ("off", 1 << 40, 0),
        ("auto", 4 * need, need),
        ("auto", 4 * need - 1, 0),
    ):
        monkeypatch.setattr(quant, "available_memory", lambda available=available: available)
        layers = model()
        assert keep_dense_copies(layers, torch.float32, mode) == kept, (mode, available)
        assert all((layer._dense is not None) == bool(kept) for layer in layers)


def test_bad_kernel_arguments_raise_clearly():
    ops = quant_ops()
    weight = quantize_dense(torch.randn(8, 64), "int8")
    with pytest.raises(RuntimeError, match="K=32 is not|columns for K=32"):
        ops.quant_matmul(torch.randn(1, 32), weight.qdata, weight.scales, None, 8, 32)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        ops.quant_matmul(torch.randn(1, 64), weight.qdata, weight.scales, None, 3, 32)
    with pytest.raises(ValueError, match="divisible by 32, got 40"):
        quantize_dense(torch.randn(4, 40), "int8")


@pytest.mark.parametrize(("method", "floor"), [("int8", 0.9999), ("int4", 0.99)])
def test_quantize_dense_fidelity(method, floor):
    w = torch.randn(256, 512)
    d = dequantize_reference(quantize_dense(w, method))
    cosine = torch.nn.functional.cosine_similarity(d.flatten(), w.flatten(), dim=0)
    assert cosine > floor


# ---- models ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_gguf():
    from factories.smollm2 import find_smollm2_gguf

    return find_smollm2_gguf()  # fails (not skips) when the weights package is missing


def test_smollm2_gguf_stays_quantized(smollm2_gguf):
    from cenote.models.config_reader import read_model_config
    from cenote.models.layers.quant import QuantEmbedding
    from cenote.models.loader import load_model

    model_config = read_model_config(str(smollm2_gguf), dtype="float32")
    model_config = dataclasses.replace(model_config, quantized_dense_copy="off")
    model = load_model(model_config)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert isinstance(layer.mlp.down_proj, QuantLinear)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    weights = [p for m in model.modules() if isinstance(m, QuantLinear) for p in m.parts]
    weights.append(model.model.embed_tokens.weight_q)  # also the tied head's QuantLinear
    quantized = sum({w.qdata.data_ptr(): w.nbytes for w in weights}.values())
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    # about the file's bytes: 4.5-5 bits per trunk weight, the rest (norms) dense fp32
    assert quantized < 110e6
    assert dense < 1e6


def test_smollm2_quantized_greedy_equals_dense(smollm2_gguf):
    """The kept-quantized GGUF generates what the dequantized (fp32) one does."""
    from cenote import LLM, SamplingParams

    prompts = ["Explain why the sky is blue.", "Write a haiku about the sea."]
    params = SamplingParams(max_tokens=32, temperature=0)
    outputs = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(smollm2_gguf), dtype="float32", quantization=quantization)
        outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    assert outputs["auto"] == outputs["none"]


def test_minilm_int8_and_int4_fidelity():
    """Weight-only int8 keeps MiniLM's embeddings at cosine >= 0.999 of fp32 (the issue's bar).
    Round-to-nearest int4 costs a 6-layer, 384-wide encoder far more (measured 0.967-0.978 on
    these texts): the test only guards against a broken int4 path (a layout bug gives ~0)."""
    from cenote import LLM
    from cenote.config import default_model_path

    minilm_path = default_model_path()
    texts = ["A man is eating food.", "The weather is lovely today, isn't it?", "Quantum " * 30]
    reference = torch.tensor(
        [o.outputs.embedding for o in LLM(str(minilm_path), dtype="float32").embed(texts)]
    )
    for method, floor in (("int8", 0.999), ("int4", 0.95)):
        llm = LLM(str(minilm_path), dtype="float32", quantization=method)
        got = torch.tensor([o.outputs.embedding for o in llm.embed(texts)])
        cosine = torch.nn.functional.cosine_similarity(got, reference, dim=-1)
        assert cosine.min() >= floor, (method, cosine)


def test_quantization_of_a_gguf_is_refused(smollm2_gguf):
    from cenote import LLM

    with pytest.raises(ValueError, match="applies to safetensors folders"):
        LLM(str(smollm2_gguf), quantization="int8")


def test_without_the_kernel_a_gguf_loads_dense(smollm2_gguf, caplog):
    """Where the kernel cannot be built the GGUF is dequantized, with one log line saying so."""
    import cenote.models.loader as loader
    from cenote.models.config_reader import read_model_config

    model_config = read_model_config(str(smollm2_gguf), dtype="float32")
    with caplog.at_level(logging.WARNING, logger="cenote.models.loader"), ops.use_torch():
        model = loader.load_model(model_config)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert "quantized kernel unavailable" in caplog.text
