from __future__ import annotations

import pytest

from cenote.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert params.n == 1
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.max_tokens == 16
    assert params.stop == []
    assert params.stop_token_ids == []
    assert params.skip_special_tokens is True
    assert params.sampling_type is SamplingType.RANDOM


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"max_tokens": -3}, "max_tokens must be at least 1, got -3"),
        ({"temperature": -0.5}, "temperature must be non-negative, got -0.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "got -2"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"n": 0}, "n must be at least 1, got 0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be positive, got 0.0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -2.1}, "frequency_penalty must be in [-2, 2], got -2.1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens (20) must be at most max_tokens (10)"),
        ({"min_tokens": -1}, "min_tokens must be non-negative, got -1"),
        ({"logprobs": -1}, "logprobs must be non-negative, got -1"),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be non-negative, got -2"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids must be non-negative, got [-1]"),
    ],
)
def test_bad_values_raise_with_numbers(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("stop", "type_name"), [(5, "int"), (["ok", 3], "int"), ({"a": 1}, "dict"), ([None], "None")]
)
def test_bad_stop_type_raises_type_error(stop: object, type_name: str) -> None:
    with pytest.raises(TypeError, match=type_name):
        SamplingParams(stop=stop)


def test_stop_is_normalised_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=["x", ""]).stop == ["x"]
    assert SamplingParams(stop=["ab", "abcd"]).max_stop_len == 4


def test_top_k_minus_one_means_off() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert not SamplingParams(temperature=0.7).is_greedy
    assert SamplingParams(temperature=0.7, seed=1).sampling_type is SamplingType.RANDOM_SEED


def test_validate_catches_later_mutation() -> None:
    params = SamplingParams()
    params.max_tokens = 0
    with pytest.raises(ValueError, match="got 0"):
        params.validate()
