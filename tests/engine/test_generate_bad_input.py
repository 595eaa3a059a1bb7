"""Bad generation input gets a clear error with the numbers, and the engine keeps working."""

from __future__ import annotations

import re

import pytest
from factories.decoders import make_decoder
from factories.generation import make_llm, random_prompts, token_prompts

from cenote import SamplingParams
from cenote.errors import InvalidInputError

MAX_MODEL_LEN = 40
PROMPTS = random_prompts([6, 9], seed=41)
GOOD = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("llama")
    make_decoder(folder, "llama")
    return make_llm(folder, block_size=4, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def baseline(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts(PROMPTS), GOOD)]


def _still_works(llm, baseline) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.client.num_unfinished == 0
    assert llm.engine.kv_cache_manager.usage == 0.0
    outs = llm.generate(token_prompts(PROMPTS), GOOD, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
        (dict(max_tokens=-3), "max_tokens must be at least 1, got -3"),
        (dict(temperature=-0.5), "temperature must be non-negative, got -0.5"),
        (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(top_p=-0.1), "top_p must be in (0, 1], got -0.1"),
        (dict(n=0), "n must be at least 1, got 0"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens (5) must be at most max_tokens (2)"),
        (dict(logprobs=-1), "logprobs must be non-negative, got -1"),
    ],
)
def test_out_of_range_sampling_params(llm, baseline, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)
    _still_works(llm, baseline)


@pytest.mark.parametrize("stop", [5, [1, 2], {"a": 1}, ["ok", None], b"bytes"])
def test_unknown_stop_type(llm, baseline, stop) -> None:
    with pytest.raises(TypeError, match="stop must be a str or a list of str"):
        SamplingParams(stop=stop)
    _still_works(llm, baseline)


def test_prompt_plus_max_tokens_over_max_model_len(llm, baseline) -> None:
    prompt = random_prompts([30], seed=42)[0]
    params = SamplingParams(max_tokens=11)  # 30 + 11 > 40
    with pytest.raises(InvalidInputError) as error:
        llm.generate(token_prompts([prompt]), params, use_tqdm=False)
    for number in ("30", "max_tokens=11", str(MAX_MODEL_LEN)):
        assert number in str(error.value)
    _still_works(llm, baseline)
    # exactly at the limit is fine, and stops at it
    (out,) = llm.generate(
        token_prompts([prompt]), SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 10
    assert out.outputs[0].finish_reason == "length"


def test_one_bad_prompt_rejects_the_batch_before_any_work(llm, baseline) -> None:
    """The second prompt is too long for its max_tokens: nothing is submitted at all."""
    prompts = token_prompts([PROMPTS[0], random_prompts([35], seed=43)[0], PROMPTS[1]])
    with pytest.raises(InvalidInputError, match="prompt 1 has 35 tokens"):
        llm.generate(prompts, GOOD, use_tqdm=False)
    _still_works(llm, baseline)


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ({"prompt_token_ids": []}, InvalidInputError, "prompt 0 is empty"),
        ({"prompt_token_ids": [3, 999]}, InvalidInputError, "token id 999 at position 1"),
        ({"prompt_token_ids": [3, -1]}, InvalidInputError, "token id -1 at position 1"),
        ({"prompt_token_ids": "w3 w4"}, TypeError, "must be a list of ints"),
        (
            {"prompt_token_ids": list(range(3, 3 + MAX_MODEL_LEN + 1))},
            InvalidInputError,
            f"has {MAX_MODEL_LEN + 1} tokens",
        ),
        (42, TypeError, "expected a string or a dict"),
        ({"text": "w3"}, TypeError, "expected a string or a dict"),
    ],
)
def test_bad_prompts(llm, baseline, prompt, error, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        llm.generate([prompt], GOOD, use_tqdm=False)
    _still_works(llm, baseline)


def test_wrong_number_of_parameter_sets(llm, baseline) -> None:
    with pytest.raises(ValueError, match="got 3 parameter sets for 2 prompts"):
        llm.generate(token_prompts(PROMPTS), [GOOD] * 3, use_tqdm=False)
    _still_works(llm, baseline)


def test_pooling_params_on_generate_are_rejected(llm, baseline) -> None:
    from cenote import PoolingParams

    with pytest.raises((TypeError, ValueError)):
        llm.generate(token_prompts(PROMPTS), PoolingParams(), use_tqdm=False)
    _still_works(llm, baseline)
