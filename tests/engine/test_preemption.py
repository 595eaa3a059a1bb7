"""Scheduling under tight budgets changes nothing: preemption (KV blocks run out) and chunked
prefill (a small token budget) give the same tokens and logprobs as a roomy engine."""

from __future__ import annotations

import pytest
from factories.decoders import make_decoder
from factories.generation import make_llm, random_prompts, record_steps, token_prompts

from cenote import SamplingParams

BLOCK_SIZE = 4
LOGPROB_ATOL = 1e-5
PROMPTS = random_prompts([10, 7, 13, 9], seed=11)
MAX_NEW = 20  # each request needs ceil((13 + 20) / 4) = 9 blocks at most
TIGHT_LEN = 40  # a small cache serves one request of max_model_len (10 blocks) at least


def _greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("llama")
    make_decoder(folder, "llama")
    return folder


@pytest.fixture(scope="module")
def roomy(folder):
    return make_llm(folder, block_size=BLOCK_SIZE)


def _count_preemptions(llm) -> list[str]:
    """Instrument the scheduler: the ids of every request it preempts, in order."""
    preempted: list[str] = []
    scheduler = llm.engine.scheduler
    original = scheduler._preempt

    def preempt(request) -> None:
        preempted.append(request.request_id)
        original(request)

    scheduler._preempt = preempt
    return preempted


def _assert_same(outs, refs, prompt_logprobs: bool = False) -> None:
    for out, ref in zip(outs, refs, strict=True):
        a, b = out.outputs[0], ref.outputs[0]
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
        if a.logprobs is not None:
            assert len(a.logprobs) == len(b.logprobs)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) <= LOGPROB_ATOL for t in x)
        if prompt_logprobs:
            assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
            assert len(out.prompt_logprobs) == len(ref.prompt_logprobs)
            for x, y in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) <= LOGPROB_ATOL for t in x)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_gives_identical_outputs(folder, roomy, prefix_caching: bool) -> None:
    params = _greedy(logprobs=3)
    refs = roomy.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    tight = make_llm(
        folder,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=14,  # 4 requests need up to 33 blocks together
        max_model_len=TIGHT_LEN,
        max_num_seqs=4,
        enable_prefix_caching=prefix_caching,
    )
    preempted = _count_preemptions(tight)
    outs = tight.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    assert preempted, "the KV budget was meant to force a preemption"
    _assert_same(outs, refs)
    # the engine is left idle with every block back in the pool
    assert not tight.engine.has_unfinished_requests()
    assert tight.engine.kv_cache_manager.usage == 0.0
    # and a second round on the same engine still matches
    _assert_same(tight.generate(token_prompts(PROMPTS), params, use_tqdm=False), refs)


def test_preemption_keeps_seeded_sampling_and_prompt_logprobs(folder, roomy) -> None:
    params = [
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            seed=100 + i,
            max_tokens=MAX_NEW,
            ignore_eos=True,
            logprobs=2,
            prompt_logprobs=2,
        )
        for i in range(len(PROMPTS))
    ]
    refs = roomy.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    tight = make_llm(
        folder, block_size=BLOCK_SIZE, num_gpu_blocks_override=14, max_model_len=TIGHT_LEN,
        max_num_seqs=4,
    )  # fmt: skip
    preempted = _count_preemptions(tight)
    outs = tight.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    assert preempted
    _assert_same(outs, refs, prompt_logprobs=True)


@pytest.mark.parametrize("budget", [3, 8])
def test_chunked_prefill_gives_identical_outputs(folder, roomy, budget: int) -> None:
    params = _greedy(logprobs=3, prompt_logprobs=3)
    refs = roomy.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    small = make_llm(folder, block_size=BLOCK_SIZE, max_num_batched_tokens=budget)
    steps = record_steps(small)
    outs = small.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    _assert_same(outs, refs, prompt_logprobs=True)
    assert all(step.total_num_scheduled_tokens <= budget for step in steps)
    # some prompt was split: a step computed part of a prompt without completing it
    assert any(
        s.sampling_params is not None and not s.needs_sample and not s.completes_prompt
        for step in steps
        for s in step.scheduled
    )


def test_chunked_prefill_with_preemption(folder, roomy) -> None:
    params = _greedy(logprobs=1)
    refs = roomy.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    tight = make_llm(
        folder,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=12,
        max_model_len=TIGHT_LEN,
        max_num_batched_tokens=6,
        max_num_seqs=3,
    )
    preempted = _count_preemptions(tight)
    outs = tight.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    assert preempted
    _assert_same(outs, refs)
