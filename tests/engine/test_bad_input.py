"""Bad input gets a clear error with the numbers, before any work, and never hurts the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_THREADS
from factories.encoders import make_encoder
from factories.texts import PARITY_TEXTS, random_prompts

from cenote import LLM, PoolingParams, SamplingParams
from cenote.errors import InvalidInputError, InvalidInputTypeError, UnknownArchitectureError

LONG_TEXT = PARITY_TEXTS[-4]  # > 256 tokens


def _assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.scheduler.requests


def test_too_long_without_truncation_names_both_numbers(llm_fp32) -> None:
    num_tokens = len(llm_fp32.tokenizer.encode(LONG_TEXT).ids)
    assert num_tokens > 256
    with pytest.raises(ValueError, match=rf"{num_tokens} tokens.*256.*truncate_prompt_tokens"):
        llm_fp32.embed(LONG_TEXT)
    ids = {"prompt_token_ids": [101] + [1996] * 300 + [102]}
    with pytest.raises(InvalidInputError, match=r"302 tokens.*256"):
        llm_fp32.embed(ids)
    _assert_idle(llm_fp32)


def test_truncation_keeps_the_requested_number_of_tokens(llm_fp32) -> None:
    (right,) = llm_fp32.embed(LONG_TEXT, truncate_prompt_tokens=10)
    (left,) = llm_fp32.embed(
        LONG_TEXT, PoolingParams(truncate_prompt_tokens=10, truncation_side="left")
    )
    full = llm_fp32.tokenizer.encode(LONG_TEXT).ids
    assert len(right.prompt_token_ids) == len(left.prompt_token_ids) == 10
    assert right.prompt_token_ids[:9] == full[:9]  # [CLS] + the first 8 words + [SEP]
    assert left.prompt_token_ids[-9:] == full[-9:]
    assert not torch.allclose(right.outputs.data, left.outputs.data)


@pytest.mark.parametrize("value", [0, -2, 257, 10_000])
def test_truncate_prompt_tokens_out_of_range(llm_fp32, value: int) -> None:
    with pytest.raises(ValueError, match=rf"between 1 and 256.*got {value}"):
        llm_fp32.embed("hello", truncate_prompt_tokens=value)
    with pytest.raises(ValueError, match=rf"got {value}"):
        llm_fp32.embed(["hello"], PoolingParams(truncate_prompt_tokens=value))
    _assert_idle(llm_fp32)


def test_unknown_pooling_task(llm_fp32) -> None:
    with pytest.raises(InvalidInputError, match="unknown pooling task 'rank'; choose one of"):
        llm_fp32.encode("hello", pooling_task="rank")


def test_dimensions_on_a_model_that_is_not_matryoshka(llm_fp32) -> None:
    with pytest.raises(ValueError, match=r"matryoshka.*384"):
        llm_fp32.embed("hello", PoolingParams(dimensions=32))
    _assert_idle(llm_fp32)
    # the full size cuts nothing: accepted (and the same vector as without it)
    full = llm_fp32.embed("hello", PoolingParams(dimensions=384))[0].outputs.embedding
    assert full == llm_fp32.embed("hello")[0].outputs.embedding


def test_dimensions_out_of_range_on_a_matryoshka_model(llm_fp32) -> None:
    llm = LLM(dtype="float32", num_threads=NUM_THREADS, hf_overrides={"is_matryoshka": True})
    with pytest.raises(ValueError, match=r"between 1 and 384.*got 385"):
        llm.embed("hello", PoolingParams(dimensions=385))
    with pytest.raises(ValueError, match=r"positive integer.*0"):
        PoolingParams(dimensions=0)
    _assert_idle(llm)
    # in range: the first 32 coordinates, renormalized
    (short,) = llm.embed("hello world", PoolingParams(dimensions=32))
    (full,) = llm_fp32.embed("hello world")
    assert short.outputs.data.shape == (32,)
    torch.testing.assert_close(
        short.outputs.data, F.normalize(full.outputs.data[:32], dim=0), atol=1e-5, rtol=0
    )


def test_unknown_architecture_lists_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["FooModel"], "vocab_size": 10, "hidden_size": 8})
    )
    with pytest.raises(UnknownArchitectureError, match=r"FooModel.*BertModel.*LlamaForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("prompt", [42, 3.5, None, b"bytes", {"text": "wrong key"}])
def test_wrong_prompt_types(llm_fp32, prompt) -> None:
    with pytest.raises(TypeError):
        llm_fp32.embed(prompt)
    with pytest.raises(TypeError):
        llm_fp32.embed(["fine", prompt])
    _assert_idle(llm_fp32)


@pytest.mark.parametrize("ids", [[101, 2, 3, 102.0], [101, True, 102], "101 102", [[101, 102]]])
def test_token_ids_of_the_wrong_type(llm_fp32, ids) -> None:
    with pytest.raises(TypeError, match="prompt_token_ids"):
        llm_fp32.embed({"prompt_token_ids": ids})
    _assert_idle(llm_fp32)


@pytest.mark.parametrize("bad_id", [30522, 10**9, -1])
def test_token_ids_outside_the_vocabulary(llm_fp32, bad_id: int) -> None:
    with pytest.raises(ValueError, match=rf"token id {bad_id} at position 1.*30522"):
        llm_fp32.embed({"prompt_token_ids": [101, bad_id, 102]})
    _assert_idle(llm_fp32)


def test_empty_inputs(llm_fp32) -> None:
    assert llm_fp32.embed([]) == []
    assert llm_fp32.encode([], pooling_task="token_embed") == []
    with pytest.raises(ValueError, match="empty"):
        llm_fp32.embed({"prompt_token_ids": []})
    _assert_idle(llm_fp32)


def test_parameter_count_must_match_prompt_count(llm_fp32) -> None:
    with pytest.raises(ValueError, match="2 parameter sets for 3 prompts"):
        llm_fp32.embed(["a", "b", "c"], [PoolingParams(), PoolingParams()])
    _assert_idle(llm_fp32)


def test_params_of_the_other_kind_are_refused(llm_fp32) -> None:
    with pytest.raises(
        InvalidInputTypeError, match="embed takes PoolingParams, got SamplingParams"
    ):
        llm_fp32.embed(["a", "b"], [PoolingParams(), SamplingParams()])
    with pytest.raises(InvalidInputTypeError, match="generate takes SamplingParams, got Pooling"):
        llm_fp32.generate("a", PoolingParams())
    _assert_idle(llm_fp32)


@pytest.mark.parametrize(
    "bad",
    [
        LONG_TEXT,
        42,
        {"prompt_token_ids": [101, 99999, 102]},
        {"prompt_token_ids": []},
    ],
)
def test_one_bad_prompt_fails_the_batch_before_any_work(llm_fp32, bad) -> None:
    good = ["The cat sat on the mat.", "Paris is the capital of France."]
    before = [out.outputs.data for out in llm_fp32.embed(good)]
    with pytest.raises((ValueError, TypeError)):
        llm_fp32.embed([good[0], bad, good[1]])
    _assert_idle(llm_fp32)
    after = llm_fp32.embed(good)
    assert [o.prompt_token_ids for o in after] == [llm_fp32.tokenizer.encode(t).ids for t in good]
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a.outputs.data, b, atol=0, rtol=0)
    _assert_idle(llm_fp32)


def test_one_bad_pooling_param_fails_the_batch_before_any_work(llm_fp32) -> None:
    params = [PoolingParams(), PoolingParams(dimensions=8), PoolingParams()]
    with pytest.raises(ValueError, match="matryoshka"):
        llm_fp32.embed(["a", "b", "c"], params)
    _assert_idle(llm_fp32)


def test_prompt_over_a_small_token_budget_is_rejected_without_leftovers(tmp_path: Path) -> None:
    """An encoder prompt cannot be split, so its budget covers max_model_len (a smaller one
    fails at start-up: test_engine_args); a longer prompt is refused with both numbers, before
    the other prompts of its batch are submitted."""
    make_encoder(tmp_path, "bert")
    llm = LLM(
        str(tmp_path), dtype="float32", num_threads=NUM_THREADS, max_num_batched_tokens=16,
        max_model_len=16,
    )  # fmt: skip
    fits, too_long = random_prompts([16, 17], seed=3)
    with pytest.raises(ValueError, match=r"17 tokens.*16"):
        llm.embed([{"prompt_token_ids": fits}, {"prompt_token_ids": too_long}])
    _assert_idle(llm)
    (out,) = llm.embed({"prompt_token_ids": fits})
    assert out.prompt_token_ids == fits
    _assert_idle(llm)
