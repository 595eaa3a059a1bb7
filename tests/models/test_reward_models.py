"""Qwen2 reward models (Qwen2.5-Math-RM / -PRM layout, remote code on the Hub, native here),
checked against a hand computation: transformers ``Qwen2Model`` hidden states -> the same MLP
head in torch."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from factories.decoders import make_qwen2_reward
from factories.seeded import set_config
from factories.vocab import VOCAB_SIZE

from cenote import LLM, PoolingParams
from cenote.errors import InvalidInputError, UnsupportedTaskError

ATOL = 1e-4
STEP_TAG = 40
PROMPTS = [
    [5, 60, 61, STEP_TAG, 70, 71, 72, STEP_TAG, 80, STEP_TAG],
    [9, 9, 50, 51, STEP_TAG],
    [7, 8, 90],  # no step tag
]


def _rewards(reference: tuple[torch.nn.Module, torch.nn.Sequential], ids: list[int]):
    trunk, head = reference
    with torch.no_grad():
        hidden = trunk(torch.tensor([ids])).last_hidden_state[0].float()  # [num_tokens, hidden]
        return head(hidden)  # [num_tokens, num_labels]


def _inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in prompts]


@pytest.fixture(scope="module", params=[1, 3], ids=["1-label", "3-labels"])
def reward_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("qwen2-rm")
    reference = make_qwen2_reward(folder, "Qwen2ForRewardModel", request.param)
    return LLM(str(folder), dtype="float32", num_threads=1), reference


@pytest.fixture(scope="module")
def process_folder(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("qwen2-prm")
    return folder, make_qwen2_reward(folder, "Qwen2ForProcessRewardModel", 2)


def test_reward_model_per_token_raw_rewards(reward_model) -> None:
    llm, reference = reward_model
    assert set(llm.supported_tasks) == {"classify", "token_classify"}
    outputs = llm.reward(_inputs(PROMPTS))
    for ids, out in zip(PROMPTS, outputs, strict=True):
        expected = _rewards(reference, ids)  # no activation: raw rewards
        assert out.outputs.data.shape == expected.shape
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_reward_model_classify_reads_the_last_token(reward_model) -> None:
    llm, reference = reward_model
    outputs = llm.classify(_inputs(PROMPTS))
    for ids, out in zip(PROMPTS, outputs, strict=True):
        expected = _rewards(reference, ids)[-1]  # [num_labels], raw
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_process_reward_softmax_at_step_rows(process_folder) -> None:
    folder, reference = process_folder
    llm = LLM(str(folder), dtype="float32", num_threads=1)
    assert llm.supported_tasks == ("token_classify",)
    outputs = llm.reward(_inputs(PROMPTS), PoolingParams(step_tag_id=STEP_TAG))
    for ids, out in zip(PROMPTS, outputs, strict=True):
        rows = torch.tensor(ids) == STEP_TAG
        expected = _rewards(reference, ids)[rows].softmax(-1)  # [num_steps, 2]
        assert out.outputs.data.shape == (int(rows.sum()), 2)
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)
    # without a step tag (request or model default): every row
    [out] = llm.reward(_inputs(PROMPTS[:1]))
    expected = _rewards(reference, PROMPTS[0]).softmax(-1)
    torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)
    # raw scores on request
    [out] = llm.reward(_inputs(PROMPTS[:1]), PoolingParams(use_activation=False))
    torch.testing.assert_close(out.outputs.data, _rewards(reference, PROMPTS[0]), atol=ATOL, rtol=0)


def test_process_reward_step_tag_from_the_config(process_folder) -> None:
    folder, reference = process_folder
    llm = LLM(str(folder), dtype="float32", num_threads=1, hf_overrides={"step_tag_id": STEP_TAG})
    by_default = llm.reward(_inputs(PROMPTS))
    for ids, out in zip(PROMPTS, by_default, strict=True):
        rows = torch.tensor(ids) == STEP_TAG
        expected = _rewards(reference, ids)[rows].softmax(-1)
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)
    # a request's own step_tag_id wins over the default
    [out] = llm.reward(_inputs(PROMPTS[:1]), PoolingParams(step_tag_id=70))
    expected = _rewards(reference, PROMPTS[0])[4:5].softmax(-1)
    torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_process_reward_errors(process_folder) -> None:
    folder, _ = process_folder
    llm = LLM(str(folder), dtype="float32", num_threads=1)
    with pytest.raises(InvalidInputError, match=f"step_tag_id {VOCAB_SIZE} is outside the vocab"):
        llm.reward("the cat", PoolingParams(step_tag_id=VOCAB_SIZE))
    with pytest.raises(InvalidInputError, match="returned_token_ids entry 2 is outside"):
        llm.reward("the cat", PoolingParams(returned_token_ids=[2]))
    with pytest.raises(UnsupportedTaskError, match="it supports token_classify"):
        llm.classify("the cat")
    with pytest.raises(ValueError, match=f"config step_tag_id {VOCAB_SIZE} is outside"):
        LLM(str(folder), dtype="float32", hf_overrides={"step_tag_id": VOCAB_SIZE})


def test_head_shape_mismatch_is_an_error(tmp_path) -> None:
    make_qwen2_reward(tmp_path, "Qwen2ForRewardModel", 2)
    set_config(tmp_path, num_labels=1)
    with pytest.raises(
        ValueError, match=r"'score\.2\.\w+' has shape \(2.*num_labels 1 expects \(1"
    ):
        LLM(str(tmp_path), dtype="float32", num_threads=1)
