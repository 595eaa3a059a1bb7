"""Sampling options through the whole engine: seeds, n > 1, stop strings / token ids, EOS,
max_tokens and min_tokens."""

from __future__ import annotations

import pytest
from factories.decoders import make_decoder
from factories.generation import make_llm, random_prompts, token_prompts

from cenote import SamplingParams

PROMPTS = random_prompts([6, 11, 4], seed=21)
MAX_NEW = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("qwen3")
    make_decoder(folder, "qwen3")
    return folder


@pytest.fixture(scope="module")
def llm(folder):
    return make_llm(folder, block_size=4)


@pytest.fixture(scope="module")
def greedy(llm) -> list:
    """Unconstrained greedy completions of PROMPTS (EOS ignored)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)]


def _sampled(seed: int | None, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        top_p=0.95,
        top_k=50,
        seed=seed,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        **extra,
    )


# ---- seeds and n ----------------------------------------------------------------------------


def test_seeded_sampling_reproducible_alone_and_in_a_batch(llm) -> None:
    prompt = token_prompts(PROMPTS[1:2])
    (alone,) = llm.generate(prompt, _sampled(7, logprobs=2), use_tqdm=False)
    (again,) = llm.generate(prompt, _sampled(7, logprobs=2), use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    # inside a batch, next to unseeded and differently seeded requests, in another position
    batch = token_prompts([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]])
    params = [_sampled(None), _sampled(7, logprobs=2), _sampled(8), _sampled(None)]
    outs = llm.generate(batch, params, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    for x, y in zip(outs[1].outputs[0].logprobs, alone.outputs[0].logprobs, strict=True):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) <= 1e-5 for t in x)
    # sampling really happened: another seed (and the unseeded twin) differ from the seed-7 run
    (other,) = llm.generate(prompt, _sampled(8), use_tqdm=False)
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def test_unseeded_sampling_differs_between_runs(llm) -> None:
    outs = llm.generate(token_prompts([PROMPTS[1]] * 4), _sampled(None), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_n_completions(llm, greedy) -> None:
    (out,) = llm.generate(token_prompts(PROMPTS[1:2]), _sampled(3, n=3), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == MAX_NEW for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    (again,) = llm.generate(token_prompts(PROMPTS[1:2]), _sampled(3, n=3), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert out.finished and all(c.finish_reason == "length" for c in out.outputs)
    # greedy n > 1: every completion is the greedy one
    params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    for out, ref in zip(outs, greedy, strict=True):
        assert [c.token_ids for c in out.outputs] == [ref.token_ids, ref.token_ids]
        assert [c.text for c in out.outputs] == [ref.text, ref.text]


# ---- stopping -------------------------------------------------------------------------------


def _stop_word(completion, start: int = 3) -> tuple[str, int]:
    """A word of the completion's text (from its ``start``-th token on) and where it first
    occurs in the text."""
    word = f"w{completion.token_ids[start]}"
    return word, completion.text.index(word)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_trimmed(llm, greedy, include: bool) -> None:
    ref = greedy[1]
    word, at = _stop_word(ref)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        stop=["never-there", word],
        include_stop_str_in_output=include,
    )
    (out,) = llm.generate(token_prompts(PROMPTS[1:2]), params, use_tqdm=False)
    completion = out.outputs[0]
    expected_text = ref.text[: at + len(word)] if include else ref.text[:at]
    assert completion.text == expected_text
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == word
    # generation stopped at the token that completed the stop string
    assert completion.token_ids == ref.token_ids[: len(completion.token_ids)]
    assert len(completion.token_ids) < MAX_NEW
    assert word in llm.tokenizer.decode(completion.token_ids)
    # the engine freed the request
    assert not llm.engine.has_unfinished_requests()


def test_stop_string_in_a_batch_stops_only_its_request(llm, greedy) -> None:
    word, at = _stop_word(greedy[0])
    stop = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop=word)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(token_prompts(PROMPTS), [stop, plain, plain], use_tqdm=False)
    assert outs[0].outputs[0].text == greedy[0].text[:at]
    assert [o.outputs[0].token_ids for o in outs[1:]] == [g.token_ids for g in greedy[1:]]


def test_stop_token_ids(llm, greedy) -> None:
    ref = greedy[1]
    stop_id = ref.token_ids[4]
    first = ref.token_ids.index(stop_id)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop_id]
    )
    (out,) = llm.generate(token_prompts(PROMPTS[1:2]), params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == ref.token_ids[: first + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop_id


def test_max_tokens_respected(llm, greedy) -> None:
    for max_tokens in (1, 5):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)
        for out, ref in zip(outs, greedy, strict=True):
            assert out.outputs[0].token_ids == ref.token_ids[:max_tokens]
            assert out.outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(folder, greedy) -> None:
    """With the model's EOS set to a token the greedy path emits, generation stops there."""
    ref = greedy[1]
    eos = ref.token_ids[5]
    first = ref.token_ids.index(eos)
    llm = make_llm(folder, block_size=4, hf_overrides={"eos_token_id": eos})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    (out,) = llm.generate(token_prompts(PROMPTS[1:2]), params, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None
    ignoring = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    (out,) = llm.generate(token_prompts(PROMPTS[1:2]), ignoring, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.token_ids
    # min_tokens bans EOS until reached
    min_tokens = first + 3
    banned = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=min_tokens)
    (out,) = llm.generate(token_prompts(PROMPTS[1:2]), banned, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) >= min_tokens
    assert eos not in tokens[:min_tokens]


def test_min_tokens_bans_stop_token_ids(llm, greedy) -> None:
    ref = greedy[1]
    stop_id = ref.token_ids[0]
    min_tokens = 6
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        stop_token_ids=[stop_id],
        min_tokens=min_tokens,
    )
    (out,) = llm.generate(token_prompts(PROMPTS[1:2]), params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) >= min_tokens
    assert stop_id not in tokens[:min_tokens]
    assert tokens[0] != ref.token_ids[0]  # the greedy first token was banned
    if out.outputs[0].finish_reason == "stop":
        assert tokens[-1] == stop_id and stop_id not in tokens[:-1]
    else:
        assert len(tokens) == MAX_NEW
