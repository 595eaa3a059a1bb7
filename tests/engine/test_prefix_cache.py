"""Prefix-cache hits change nothing but the work done: same tokens, same logprobs."""

from __future__ import annotations

import pytest
from factories.decoders import make_decoder
from factories.generation import make_llm, random_prompts, token_prompts

from cenote import SamplingParams

BLOCK_SIZE = 4
LOGPROB_ATOL = 1e-5  # fp32, same model: a cached prefix only changes the order of the work
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("qwen2")
    make_decoder(folder, "qwen2")
    return folder


@pytest.fixture
def llm(folder):
    return make_llm(folder, block_size=BLOCK_SIZE)


def _same(a, b) -> None:
    """Two completions: identical tokens, logprobs within LOGPROB_ATOL."""
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(b.logprobs)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert set(x) == set(y)
        for token_id in x:
            assert abs(x[token_id].logprob - y[token_id].logprob) <= LOGPROB_ATOL


def test_repeated_prompt_hits_the_cache_with_identical_output(folder, llm) -> None:
    prompt = random_prompts([18], seed=3)[0]
    cold_llm = make_llm(folder, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    (cold,) = cold_llm.generate(token_prompts([prompt]), PARAMS, use_tqdm=False)
    assert cold.num_cached_tokens == 0

    (first,) = llm.generate(token_prompts([prompt]), PARAMS, use_tqdm=False)
    hits_before = llm.engine.kv_cache_manager.hits
    (second,) = llm.generate(token_prompts([prompt]), PARAMS, use_tqdm=False)
    # 18 tokens = 4 full blocks (16 tokens); the last token is always computed
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 16
    assert llm.engine.kv_cache_manager.hits - hits_before == 16
    _same(first.outputs[0], cold.outputs[0])
    _same(second.outputs[0], cold.outputs[0])


def test_shared_prefix_different_suffix(folder, llm) -> None:
    prefix = random_prompts([12], seed=4)[0]
    a, b = (prefix + s for s in random_prompts([5, 7], seed=5))
    cold_llm = make_llm(folder, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    cold = cold_llm.generate(token_prompts([a, b]), PARAMS, use_tqdm=False)

    (warm_a,) = llm.generate(token_prompts([a]), PARAMS, use_tqdm=False)
    (warm_b,) = llm.generate(token_prompts([b]), PARAMS, use_tqdm=False)
    assert warm_a.num_cached_tokens == 0
    assert warm_b.num_cached_tokens == 12
    _same(warm_a.outputs[0], cold[0].outputs[0])
    _same(warm_b.outputs[0], cold[1].outputs[0])


def test_prompt_and_generated_tokens_cached_for_a_continuation(folder, llm) -> None:
    """A follow-up whose prompt is an earlier prompt + its completion reuses both."""
    prompt = random_prompts([9], seed=6)[0]
    (first,) = llm.generate(token_prompts([prompt]), PARAMS, use_tqdm=False)
    follow_up = prompt + first.outputs[0].token_ids + random_prompts([3], seed=7)[0]
    (warm,) = llm.generate(token_prompts([follow_up]), PARAMS, use_tqdm=False)
    cold_llm = make_llm(folder, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    (cold,) = cold_llm.generate(token_prompts([follow_up]), PARAMS, use_tqdm=False)
    assert warm.num_cached_tokens >= 16  # prompt (9) + 12 generated -> at least 4 full blocks
    _same(warm.outputs[0], cold.outputs[0])


def test_prompt_logprobs_complete_after_a_cache_hit(llm) -> None:
    """Prompt logprobs need every prompt position's logits: such a request must not skip the
    cached prefix (it used to return only the uncached positions)."""
    prompt = random_prompts([14], seed=8)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    (plain,) = llm.generate(token_prompts([prompt]), PARAMS, use_tqdm=False)  # fills the cache
    (first,) = llm.generate(token_prompts([prompt]), params, use_tqdm=False)
    (again,) = llm.generate(token_prompts([prompt]), params, use_tqdm=False)
    for out in (first, again):
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        assert all(prompt[i] in out.prompt_logprobs[i] for i in range(1, len(prompt)))
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids[:4]
    for x, y in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:], strict=True):
        assert {k: v.logprob for k, v in x.items()} == {k: v.logprob for k, v in y.items()}
    # an ordinary request after them still hits the cache
    (warm,) = llm.generate(token_prompts([prompt]), PARAMS, use_tqdm=False)
    assert warm.num_cached_tokens == 12
    _same(warm.outputs[0], plain.outputs[0])


def test_cache_hit_inside_a_batch_is_batch_invariant(folder, llm) -> None:
    prompts = random_prompts([10, 16, 21], seed=9)
    llm.generate(token_prompts(prompts[1:2]), PARAMS, use_tqdm=False)  # warm one of them
    warm = llm.generate(token_prompts(prompts), PARAMS, use_tqdm=False)
    cold_llm = make_llm(folder, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    cold = cold_llm.generate(token_prompts(prompts), PARAMS, use_tqdm=False)
    assert warm[1].num_cached_tokens == 12  # (16 - 1) // 4 full blocks
    for w, c in zip(warm, cold, strict=True):
        _same(w.outputs[0], c.outputs[0])
