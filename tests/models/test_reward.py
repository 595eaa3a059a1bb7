"""Process reward (STEP pooling) and causal LMs converted to classifiers (classifier_from_token,
Qwen3-Reranker style), checked by hand against transformers logits."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest
import torch
from factories.decoders import make_pooling_decoder
from factories.vocab import VOCAB_SIZE
from tokenizers import Tokenizer

from cenote import LLM, PoolingParams
from cenote.errors import InvalidInputError, UnsupportedTaskError

ATOL = 1e-4
STEP_TAG = 40
PLUS, MINUS = 13, 14  # "+" and "-" in the factory vocabulary
PROMPTS = [
    [5, 60, 61, STEP_TAG, 70, 71, 72, STEP_TAG, 80, STEP_TAG],
    [9, 9, 50, 51, STEP_TAG],
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def causal(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = make_pooling_decoder(folder, request.param, "ForCausalLM")
    return folder, reference


def _logits(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()  # [num_tokens, vocab]


def test_step_pooling_matches_hand_computation(causal) -> None:
    folder, reference = causal
    llm = LLM(str(folder), dtype="float32", num_threads=1)
    assert "token_classify" in llm.supported_tasks and "generate" in llm.supported_tasks
    params = PoolingParams(step_tag_id=STEP_TAG, returned_token_ids=[PLUS, MINUS])
    outputs = llm.reward([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    for ids, out in zip(PROMPTS, outputs, strict=True):
        logits = _logits(reference, ids)
        rows = torch.tensor(ids) == STEP_TAG
        expected = logits[rows][:, [PLUS, MINUS]].softmax(-1)  # [num_steps, 2]
        assert out.outputs.data.shape == (int(rows.sum()), 2)
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_step_tag_outside_vocabulary_is_an_error(causal) -> None:
    llm = LLM(str(causal[0]), dtype="float32", num_threads=1)
    with pytest.raises(InvalidInputError, match=f"step_tag_id {VOCAB_SIZE} is outside the vocab"):
        llm.reward("the cat", PoolingParams(step_tag_id=VOCAB_SIZE))
    with pytest.raises(InvalidInputError, match="returned_token_ids entry -1"):
        llm.reward("the cat", PoolingParams(returned_token_ids=[-1]))
    with pytest.raises(UnsupportedTaskError, match="it supports generate, embed"):
        llm.classify("the cat")


def _qwen3_reranker_prompt(query: str, document: str, instruction: str) -> str:
    """The prompt of the Qwen3-Reranker model card, written out by hand."""
    prefix = (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
        'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
        "<|im_end|>\n<|im_start|>user\n"
    )
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    return f"{prefix}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{suffix}"


def test_qwen3_reranker_from_yes_no_tokens(causal) -> None:
    folder, reference = causal
    overrides = {
        "architectures": [
            reference.config.architectures[0].replace("CausalLM", "Sequence") + "Classification"
        ],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }
    llm = LLM(str(folder), dtype="float32", num_threads=1, hf_overrides=overrides)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    yes, no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
    query, documents = "the cat", ["a cat sat on the mat", "dog w70", "yes no"]
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    outputs = llm.score(query, documents)
    for document, out in zip(documents, outputs, strict=True):
        ids = tokenizer.encode(_qwen3_reranker_prompt(query, document, instruction)).ids
        assert out.prompt_token_ids == ids
        last = _logits(reference, ids)[-1]
        expected = torch.sigmoid(last[yes] - last[no]).item()
        assert abs(out.outputs.score - expected) < ATOL


def test_convert_classify_with_token_rows(causal) -> None:
    folder, reference = causal
    llm = LLM(
        str(folder),
        dtype="float32",
        num_threads=1,
        convert="classify",
        hf_overrides={"classifier_from_token": ["no", "yes", "cat"]},
    )
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rows = [tokenizer.token_to_id(t) for t in ("no", "yes", "cat")]
    ids = PROMPTS[0]
    [out] = llm.classify({"prompt_token_ids": ids})
    expected = _logits(reference, ids)[-1, rows].softmax(-1)
    torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_one_batch_mixes_embed_and_reward_rows(causal) -> None:
    from cenote.pooling.metadata import PoolingMetadata

    llm = LLM(str(causal[0]), dtype="float32", num_threads=1)
    pooler = llm.engine.pooler
    hidden = torch.randn(8, 64)
    embed = PoolingParams(task="embed")
    reward = PoolingParams(task="token_classify", returned_token_ids=[PLUS, MINUS])
    mixed = pooler(hidden, PoolingMetadata([0, 3, 8], [reward, embed], [[1, 2, 3], [4] * 5]))
    alone_reward = pooler(hidden[:3], PoolingMetadata([0, 3], [reward], [[1, 2, 3]]))[0]
    alone_embed = pooler(hidden[3:], PoolingMetadata([0, 5], [embed], [[4] * 5]))[0]
    torch.testing.assert_close(mixed[0], alone_reward)
    torch.testing.assert_close(mixed[1], alone_embed)
