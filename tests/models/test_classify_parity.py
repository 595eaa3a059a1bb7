"""Classification heads vs transformers on tiny random models: logits and probabilities."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
from factories.decoders import make_pooling_decoder
from factories.encoders import make_encoder_classifier

from cenote import LLM, PoolingParams
from cenote.errors import InvalidInputError, UnsupportedTaskError

ATOL = 1e-4
PROMPTS = [[7, 20, 33, 41, 9], [12, 5, 88], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
LABELS = {0: "negative", 1: "positive", 2: "neutral"}


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_threads=1, **kwargs)


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_encoder_sequence_classifier_matches_transformers(family: str, tmp_path: Path) -> None:
    ref = make_encoder_classifier(
        tmp_path, family, "ForSequenceClassification", num_labels=3, id2label=LABELS
    )
    llm = _llm(tmp_path)
    assert llm.supported_tasks == ("classify",)
    inputs = [{"prompt_token_ids": ids} for ids in PROMPTS]
    probs = llm.classify(inputs)
    raw = llm.classify(inputs, PoolingParams(use_activation=False))
    for ids, p, r in zip(PROMPTS, probs, raw, strict=True):
        expected = _hf_logits(ref, ids)  # [num_labels]
        torch.testing.assert_close(r.outputs.data, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(p.outputs.data, expected.softmax(-1), atol=ATOL, rtol=0)
        assert p.outputs.label_names == ("negative", "positive", "neutral")
        assert len(p.outputs.probs) == p.outputs.num_classes == 3


@pytest.mark.parametrize(
    ("config", "activation"),
    [
        (dict(num_labels=1), torch.sigmoid),
        (dict(num_labels=3, problem_type="multi_label_classification"), torch.sigmoid),
        (dict(num_labels=2, problem_type="regression"), lambda x: x),
    ],
    ids=["one-label", "multi-label", "regression"],
)
def test_activation_follows_the_config(config: dict, activation, tmp_path: Path) -> None:
    ref = make_encoder_classifier(tmp_path, "bert", "ForSequenceClassification", **config)
    out = _llm(tmp_path).classify({"prompt_token_ids": PROMPTS[0]})[0]
    expected = activation(_hf_logits(ref, PROMPTS[0]))
    torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_token_classifier_matches_transformers(tmp_path: Path) -> None:
    ref = make_encoder_classifier(tmp_path, "bert", "ForTokenClassification", num_labels=5)
    llm = _llm(tmp_path)
    assert llm.supported_tasks == ("token_classify",)
    outputs = llm.encode(
        [{"prompt_token_ids": ids} for ids in PROMPTS], pooling_task="token_classify"
    )
    for ids, out in zip(PROMPTS, outputs, strict=True):
        expected = _hf_logits(ref, ids).softmax(-1)  # [num_tokens, num_labels]
        assert out.outputs.data.shape == (len(ids), 5)
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_decoder_classifier_and_reward_match_transformers(variant: str, tmp_path: Path) -> None:
    ref = make_pooling_decoder(tmp_path, variant, "ForSequenceClassification", num_labels=2)
    llm = _llm(tmp_path)
    inputs = [{"prompt_token_ids": ids} for ids in PROMPTS]
    classified = llm.classify(inputs)
    rewards = llm.reward(inputs, PoolingParams(use_activation=False))
    for ids, c, r in zip(PROMPTS, classified, rewards, strict=True):
        with torch.no_grad():
            hidden = ref.model(torch.tensor([ids])).last_hidden_state[0]
            per_token = ref.score(hidden).float()  # [num_tokens, 2]: ALL pooling of the head
        expected = _hf_logits(ref, ids)  # transformers pools the last token
        torch.testing.assert_close(c.outputs.data, expected.softmax(-1), atol=ATOL, rtol=0)
        torch.testing.assert_close(r.outputs.data, per_token, atol=ATOL, rtol=0)
        torch.testing.assert_close(per_token[-1], expected, atol=ATOL, rtol=0)


def test_task_and_option_errors(tmp_path: Path) -> None:
    make_encoder_classifier(tmp_path, "bert", "ForSequenceClassification", num_labels=2)
    llm = _llm(tmp_path)
    with pytest.raises(UnsupportedTaskError, match="it supports classify"):
        llm.embed("the cat")
    with pytest.raises(InvalidInputError, match="dimensions applies to embeddings"):
        llm.classify("the cat", PoolingParams(dimensions=8))
    with pytest.raises(InvalidInputError, match="step_tag_id"):
        llm.classify("the cat", PoolingParams(step_tag_id=3))
