"""The C++ decode stack (cenote/kernels/decode_stack.cpp) against the Python layer loop it
replaces (``LlamaModel.forward``'s layer loop): bit-identical tokens and logprobs, on tiny quantized
and dense decoders (GQA, q/k/v biases, sliding-window layers next to full ones), with LoRA
adapters written by ``peft`` mixed in one step, and on SmolLM2's GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from factories.decoders import GENERATION_DECODER, make_decoder, save_generation_decoder
from factories.generation import make_llm, random_prompts, token_prompts
from factories.lora import write_adapter
from factories.seeded import hf_config, random_model

from cenote import LoRARequest, SamplingParams
from cenote.kernels import attention_ops, quant_ops
from cenote.models.layers import lora
from cenote.models.layers.linear import pack_weight
from cenote.models.layers.quant import DOT_MAX_ROWS, DOT_MAX_ROWS_WITH_COPY, QuantLinear
from cenote.models.llama import LlamaModel
from cenote.runner.decode_stack import DecodeStackStep

pytestmark = pytest.mark.skipif(
    quant_ops() is None or attention_ops() is None, reason="C++ kernels not buildable"
)

# name -> (config class, causal-LM class, overrides)
VARIANTS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    # q/k/v biases; layer 1 slides over 5 positions, layer 0 sees everything
    "qwen2_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
        ),
    ),
}


def _trunk(llm) -> LlamaModel:
    trunk = llm.engine.runner.model.model
    assert isinstance(trunk, LlamaModel)
    return trunk


def _run(llm, prompts, params, *, stack: bool, monkeypatch: pytest.MonkeyPatch, adapters=None):
    """Tokens and logprobs of ``prompts``, with the stack or the Python loop; per fused-decode
    call, whether the stack ran it (``calls``) and (whether a row of it had an adapter, its
    rows)."""
    calls, with_lora = [], []
    original = DecodeStackStep.__call__

    def decode_step(self, x, *args):
        result = original(self, x, *args) if stack else None
        calls.append(result is not None)
        with_lora.append((lora.active_lora_batch() is not None, x.shape[0]))
        return result

    with monkeypatch.context() as patch:
        patch.setattr(DecodeStackStep, "__call__", decode_step)
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [
        [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs]
        for o in outputs
    ]
    return tokens, logprobs, (calls, with_lora)


def _dense_bf16_packs() -> bool:
    """Whether oneDNN prepacks a bf16 weight here (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT;
    AVX2-only CPUs such as AMD Zen 3 multiply bf16 unpacked, and the stack does not take it)."""
    return pack_weight(torch.zeros(8, 8, dtype=torch.bfloat16)) is not None


def _assert_same_as_python_loop(
    llm, prompts, params, monkeypatch, *, stack=True, adapters=None
) -> list[tuple[bool, bool]]:
    """Returns, per fused-decode call of the stack's run: (the stack ran it, it had LoRA rows,
    its rows)."""
    if adapters is not None:
        # adapters resident before both runs: a first use reads the folder in the background
        # (its requests join a later step), so both runs schedule the same steps; a quantized
        # step's kernel depends on its row count (the row kernel up to 8 rows, the dense copy
        # above), so only equal steps may be compared bit for bit
        for adapter in {a.lora_int_id: a for a in adapters if a is not None}.values():
            llm.generate(
                [prompts[0]], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=adapter
            )
    tokens, logprobs, (calls, with_lora) = _run(
        llm, prompts, params, stack=True, monkeypatch=monkeypatch, adapters=adapters
    )
    if not stack:  # the stack declines these layers: every step is the Python loop's
        assert not any(calls), "the decode stack ran on layers it cannot multiply"
        assert _trunk(llm).fused_decode is None
        return [(ran, *step) for ran, step in zip(calls, with_lora, strict=True)]
    assert any(calls), "the decode stack never ran"
    assert not all(calls), "prefill steps must take the Python loop"
    ref_tokens, ref_logprobs, _ = _run(
        llm, prompts, params, stack=False, monkeypatch=monkeypatch, adapters=adapters
    )
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs
    return [(ran, *step) for ran, step in zip(calls, with_lora, strict=True)]


def _save(tmp_path: Path, variant: str) -> Path:
    config_class, model_class, overrides = VARIANTS[variant]
    config = hf_config(config_class, GENERATION_DECODER, overrides, {})
    save_generation_decoder(tmp_path, random_model(model_class, config, seed=3))
    return tmp_path


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_stack_equals_python_loop(variant, dtype, quantization, tmp_path: Path, monkeypatch):
    """Quantized projections (the fused kernel up to their row limit, then their dense copy)
    and dense ones (oneDNN-prepacked) alike."""
    # no prefix caching: the second run must compute its prompts as the first did
    llm = make_llm(
        _save(tmp_path, variant),
        dtype=dtype,
        quantization=quantization,
        block_size=4,
        enable_prefix_caching=False,
    )
    # 1 to 6 streams decode together (past bf16's 4-row limit of the fused kernel), past the
    # window and block boundaries
    prompts = token_prompts(random_prompts([3, 9, 14, 5, 7, 4], seed=1))
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
        for n in (12, 4, 9, 12, 2, 7)
    ]
    # dense bf16 layers without a oneDNN-packed weight have nothing the stack multiplies
    stack = not (dtype == "bfloat16" and quantization == "none" and not _dense_bf16_packs())
    _assert_same_as_python_loop(llm, prompts, params, monkeypatch, stack=stack)
    if stack:
        assert isinstance(_trunk(llm).fused_decode, DecodeStackStep)


@pytest.mark.skipif(
    quant_ops() is None or not quant_ops().quant_dot_supported(), reason="no AVX512-BF16"
)
@pytest.mark.parametrize("dense_copy", ["off", "on"])
def test_bf16_dot_products_in_the_stack_equal_the_python_loop(dense_copy, tmp_path, monkeypatch):
    """4-bit layers in bf16 multiply 5 or more rows on bf16 dot products (quant_matmul_dot),
    in the stack as in the Python loop, with a dense copy (up to 32 rows) or without."""
    llm = make_llm(
        _save(tmp_path, "llama"),
        dtype="bfloat16",
        quantization="int4",
        quantized_dense_copy=dense_copy,
        enable_prefix_caching=False,
    )
    trunk = _trunk(llm)
    prompts = token_prompts(random_prompts([3, 9, 14, 5, 7, 4, 6, 8], seed=4))
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
        for n in (12, 4, 9, 12, 2, 7, 10, 11)
    ]
    _assert_same_as_python_loop(llm, prompts, params, monkeypatch)
    layers = [m for m in trunk.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.dot_max_rows > 0 for m in layers)
    assert all((m.dense_packed is not None) == (dense_copy == "on") for m in layers)
    if dense_copy == "off":
        assert trunk.fused_decode.max_rows == DOT_MAX_ROWS


def test_quantized_without_dense_copy_keeps_its_row_limit(tmp_path: Path, monkeypatch):
    """Without dense copies, steps above the fused kernel's rows take the Python loop (which
    dequantizes); fewer rows the stack."""
    llm = make_llm(
        _save(tmp_path, "llama"),
        quantization="int8",
        quantized_dense_copy="off",
        enable_prefix_caching=False,
    )
    trunk = _trunk(llm)
    prompts = token_prompts(random_prompts([3] * 10, seed=2))
    # 10 streams decode together, then fewer as they finish
    params = [
        SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True, logprobs=1)
        for i in range(10)
    ]
    _assert_same_as_python_loop(llm, prompts, params, monkeypatch)
    assert trunk.fused_decode.max_rows == 8


def test_smollm2_stack_equals_python_loop(monkeypatch):
    """SmolLM2's Q4_1 GGUF (w4 with mins, the Q8_0 tied head) decodes identically."""
    from factories.smollm2 import find_smollm2_gguf

    from cenote import LLM

    llm = LLM(str(find_smollm2_gguf()), dtype="float32", enable_prefix_caching=False)
    prompts = ["Write a haiku about the sea.", "What is 2 + 2?"]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    _assert_same_as_python_loop(llm, prompts, params, monkeypatch)


@pytest.mark.skipif(
    quant_ops() is None or not quant_ops().quant_dot_supported(), reason="no AVX512-BF16"
)
def test_smollm2_bf16_dot_products_equal_the_python_loop(monkeypatch):
    """bf16 SmolLM2 at 6 streams: its Q4_1 layers (fp16 scales and mins) multiply on bf16 dot
    products (the Q8_0 LM head, 8-bit, on its dense copy)."""
    from factories.smollm2 import find_smollm2_gguf

    from cenote import LLM

    llm = LLM(str(find_smollm2_gguf()), dtype="bfloat16", enable_prefix_caching=False)
    prompts = [f"Tell me fact number {i} about the sea." for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    _assert_same_as_python_loop(llm, prompts, params, monkeypatch)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    dots = sorted(m.dot_max_rows for m in layers)
    assert len(layers) == 121 and dots == [0] + [DOT_MAX_ROWS_WITH_COPY] * 120


# ---- LoRA adapters in the stack ------------------------------------------------------------------

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> peft LoraConfig options: every projection; q/v with rsLoRA (a block of the fused qkv
# and gaps between); the MLP only
ADAPTERS: dict[str, dict] = {
    "all": dict(target_modules=ALL_PROJECTIONS, r=4, lora_alpha=8),
    "qv": dict(target_modules=["q_proj", "v_proj"], r=8, lora_alpha=4, use_rslora=True),
    "mlp": dict(target_modules=["gate_proj", "up_proj", "down_proj"], r=2, lora_alpha=16),
}


@pytest.fixture(scope="module")
def lora_decoder(tmp_path_factory) -> tuple[Path, dict[str, LoRARequest]]:
    """A tiny Llama and the three ``ADAPTERS``, written by peft."""
    root = tmp_path_factory.mktemp("stack_lora")
    base = make_decoder(root / "base", "llama")
    adapters = {}
    for i, (name, options) in enumerate(ADAPTERS.items()):
        options = dict(options)
        targets = options.pop("target_modules")
        write_adapter(base, root / name, 20 + i, targets, **options)
        adapters[name] = LoRARequest(name, i + 1, str(root / name))
    return root / "base", adapters


def _lora_llm(base: Path, **options):
    # no prefix caching: the second run must compute its prompts as the first did
    return make_llm(base, block_size=4, enable_prefix_caching=False, max_lora_rank=8, **options)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_stack_with_adapters_equals_python_loop(lora_decoder, dtype, quantization, monkeypatch):
    """Three adapters and base rows in one decode step: the stack adds each projection's
    updates with the linear layers' kernel and factors (the fp32 copies on bf16), so tokens and
    logprobs are bit-identical to the layer loop's."""
    base, adapters = lora_decoder
    llm = _lora_llm(base, dtype=dtype, quantization=quantization)
    names = [None, "all", "qv", "mlp", "all", None, "mlp"]
    prompts = token_prompts(random_prompts([3, 9, 14, 5, 7, 4, 6], seed=1))
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
        for n in (12, 4, 9, 12, 2, 7, 10)
    ]
    chosen = [None if name is None else adapters[name] for name in names]
    stack = not (dtype == "bfloat16" and quantization == "none" and not _dense_bf16_packs())
    calls = _assert_same_as_python_loop(
        llm, prompts, params, monkeypatch, stack=stack, adapters=chosen
    )
    if stack:
        assert any(ran and has_lora for ran, has_lora, _ in calls), "no adapter step ran"


def test_stack_steps_aside_for_runs_past_the_lora_kernel(lora_decoder, monkeypatch):
    """Where an adapter's run is longer than the LoRA kernel takes, the layers multiply it in
    torch (bf16 factors on long bf16 runs); the stack declines those steps rather than differ,
    and takes the shorter ones."""
    base, adapters = lora_decoder
    llm = _lora_llm(base, dtype="float32", quantization="int8")
    monkeypatch.setitem(lora.KERNEL_MAX_RUN_ROWS, torch.float32, 2)
    prompts = token_prompts(random_prompts([3, 9, 14, 5], seed=2))
    # one prefill step of 31 rows, then 4 decode rows of one adapter, then 2 as two finish
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
        for n in (3, 3, 8, 8)
    ]
    calls = _assert_same_as_python_loop(
        llm, prompts, params, monkeypatch, adapters=[adapters["all"]] * 4
    )
    assert (False, True, 4) in calls and (True, True, 2) in calls
