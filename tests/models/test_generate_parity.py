"""Greedy generation and logprobs match transformers, on tiny random decoders and on SmolLM2."""

from __future__ import annotations

import pytest
import torch
from factories.decoders import DECODER_FAMILIES, make_decoder
from factories.generation import (
    hf_greedy,
    hf_log_softmax,
    make_llm,
    random_prompts,
    record_steps,
    smollm2_hf,
    smollm2_path,
    token_prompts,
)

from cenote import LLM, SamplingParams

MAX_NEW = 24
LOGPROB_ATOL = 1e-3
NUM_LOGPROBS = 5
PROMPT_LENGTHS = [1, 5, 9, 17, 30]  # a lone token, within a block, across blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(DECODER_FAMILIES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    theirs = make_decoder(folder, request.param)
    ours = make_llm(folder, block_size=4)
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    expected = hf_greedy(theirs, prompts, MAX_NEW)
    return ours, theirs, prompts, expected


def test_greedy_alone_matches_transformers(tiny) -> None:
    ours, _, prompts, expected = tiny
    for prompt, tokens in zip(prompts, expected, strict=True):
        (out,) = ours.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == tokens
        assert out.outputs[0].finish_reason == "length"
        assert out.prompt_token_ids == prompt


def test_greedy_batched_matches_transformers(tiny) -> None:
    ours, _, prompts, expected = tiny
    outs = ours.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # a shuffled batch returns outputs in input order, and each is unchanged
    order = [3, 0, 4, 2, 1]
    outs = ours.generate(token_prompts([prompts[i] for i in order]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected[i] for i in order]


def test_text_prompts_match_token_prompts(tiny) -> None:
    ours, _, prompts, expected = tiny
    texts = [" ".join(f"w{t}" for t in p) for p in prompts]
    outs = ours.generate(texts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[1].outputs[0].text.split() == [f"w{t}" for t in expected[1]]


def _check_logprobs(entry: dict, chosen: int, reference: torch.Tensor, k: int) -> None:
    """One position: the chosen token plus the top k, against a reference log-softmax row."""
    top = torch.topk(reference, k)
    expected_ids = {chosen, *top.indices.tolist()}
    assert set(entry) == expected_ids
    for token_id, logprob in entry.items():
        assert abs(logprob.logprob - reference[token_id].item()) <= LOGPROB_ATOL, token_id
    expected_rank = int((reference > reference[chosen]).sum()) + 1
    assert entry[chosen].rank == expected_rank


def test_logprobs_and_prompt_logprobs_match_transformers(tiny) -> None:
    ours, theirs, prompts, expected = tiny
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        logprobs=NUM_LOGPROBS,
        prompt_logprobs=NUM_LOGPROBS,
    )
    outs = ours.generate(token_prompts(prompts), params, use_tqdm=False)
    for prompt, tokens, out in zip(prompts, expected, outs, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        reference = hf_log_softmax(theirs, prompt + tokens)  # row i predicts token i + 1
        # sampled tokens
        assert len(completion.logprobs) == MAX_NEW
        for step, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
            _check_logprobs(entry, token, reference[len(prompt) - 1 + step], NUM_LOGPROBS)
        cumulative = sum(reference[len(prompt) - 1 + s, t].item() for s, t in enumerate(tokens))
        assert completion.cumulative_logprob == pytest.approx(cumulative, abs=MAX_NEW * 1e-4)
        # prompt tokens: None for the first, then one entry per prompt token
        assert out.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            _check_logprobs(out.prompt_logprobs[i], prompt[i], reference[i - 1], NUM_LOGPROBS)


def test_prompt_logprobs_in_bounded_chunks_match_one_pass_and_transformers(tmp_path) -> None:
    """A prompt asking for prompt logprobs is computed max_prompt_logprobs_tokens at a time, in
    several steps, with the logprobs of one unchunked pass (and of transformers)."""
    theirs = make_decoder(tmp_path, "llama")
    prompts = random_prompts([40, 13], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    whole = make_llm(tmp_path, block_size=4)
    chunked = make_llm(tmp_path, block_size=4, max_prompt_logprobs_tokens=8)
    steps = record_steps(chunked)
    outs = chunked.generate(token_prompts(prompts), params, use_tqdm=False)
    refs = whole.generate(token_prompts(prompts), params, use_tqdm=False)
    # 53 prompt tokens, at most 8 a step (both prompts together): at least 7 steps of prompt
    num_prompt_tokens = [
        sum(max(min(r.num_tokens, len(r.prompt_token_ids) - r.start_position), 0)
            for r in step.scheduled)
        for step in steps
    ]  # fmt: skip
    assert sum(num_prompt_tokens) == 53 and max(num_prompt_tokens) == 8
    assert len([n for n in num_prompt_tokens if n]) >= 7
    for prompt, out, ref in zip(prompts, outs, refs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        reference = hf_log_softmax(theirs, prompt)
        for i in range(1, len(prompt)):
            entry, one_pass = out.prompt_logprobs[i], ref.prompt_logprobs[i]
            assert entry.keys() == one_pass.keys()
            for token_id, logprob in entry.items():
                assert logprob.rank == one_pass[token_id].rank
                assert abs(logprob.logprob - one_pass[token_id].logprob) <= 1e-5
            _check_logprobs(entry, prompt[i], reference[i - 1], 3)


def test_logprobs_zero_returns_only_the_chosen_token(tiny) -> None:
    ours, theirs, prompts, expected = tiny
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    (out,) = ours.generate(token_prompts(prompts[2:3]), params, use_tqdm=False)
    reference = hf_log_softmax(theirs, prompts[2] + expected[2][:4])
    for step, entry in enumerate(out.outputs[0].logprobs):
        token = expected[2][step]
        assert list(entry) == [token]
        assert abs(entry[token].logprob - reference[len(prompts[2]) - 1 + step, token]) <= 1e-3


# ---- the real SmolLM2 -------------------------------------------------------------------------

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]
SMOL_NEW = 32


@pytest.fixture(scope="module")
def smollm2() -> tuple[LLM, torch.nn.Module]:
    path = smollm2_path()
    return LLM(str(path), dtype="float32", num_threads=2), smollm2_hf(path)


def test_smollm2_greedy_matches_transformers(smollm2) -> None:
    ours, theirs = smollm2
    params = SamplingParams(
        temperature=0.0, max_tokens=SMOL_NEW, ignore_eos=True, logprobs=NUM_LOGPROBS
    )
    outs = ours.generate(SMOL_PROMPTS, params, use_tqdm=False)
    prompts = [o.prompt_token_ids for o in outs]
    expected = hf_greedy(theirs, prompts, SMOL_NEW)
    for prompt, tokens, out in zip(prompts, expected, outs, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        reference = hf_log_softmax(theirs, prompt + tokens)
        for step, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
            _check_logprobs(entry, token, reference[len(prompt) - 1 + step], NUM_LOGPROBS)
    assert "Paris" in outs[0].outputs[0].text


def test_smollm2_alone_equals_batched(smollm2) -> None:
    ours, _ = smollm2
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batched = ours.generate(SMOL_PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(SMOL_PROMPTS, batched, strict=True):
        (alone,) = ours.generate(prompt, params, use_tqdm=False)
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.outputs[0].text == out.outputs[0].text
