"""Prompts made in parts beside the steps (``LLM`` off the CPU: the next part is tokenized on a
worker thread while the engine steps the parts already added). Forced here on the CPU with
small parts: the same outputs as one batch, errors as one batch raises them, engine alive."""

from __future__ import annotations

import pytest
import torch

from cenote import LLM, PoolingParams
from cenote import llm as llm_module
from cenote.errors import InvalidInputError

TEXTS = [f"text number {i}: " + "word " * (i % 7) for i in range(11)]


@pytest.fixture
def in_parts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every call made in parts of 4 prompts; records the prompt count of each part made."""
    made: list[int] = []
    monkeypatch.setattr(llm_module, "_INPUT_PART", 4)
    monkeypatch.setattr(llm_module, "_made_beside_steps", lambda device, n: n >= 8)
    process_batch = llm_module.InputProcessor.process_batch

    def recorded(self, request_ids, *args, **kwargs):
        made.append(len(request_ids))
        return process_batch(self, request_ids, *args, **kwargs)

    monkeypatch.setattr(llm_module.InputProcessor, "process_batch", recorded)
    return made


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def test_parts_give_the_outputs_of_one_batch(llm_fp32: LLM, in_parts: list[int]) -> None:
    whole = _vectors(llm_fp32.embed(TEXTS[:7], use_tqdm=False))  # under 2 parts: one batch
    assert in_parts == [7]
    parted = llm_fp32.embed(TEXTS, use_tqdm=False)
    assert in_parts == [7, 4, 4, 3]
    expected_ids = [e.ids for e in llm_fp32.tokenizer.encode_batch(TEXTS)]
    assert [o.prompt_token_ids for o in parted] == expected_ids, "outputs out of prompt order"
    assert torch.equal(_vectors(parted)[:7], whole)
    per_prompt = [PoolingParams(normalize=i % 2 == 0) for i in range(len(TEXTS))]
    mixed = llm_fp32.embed(TEXTS, per_prompt, use_tqdm=False)
    norms = _vectors(mixed).norm(dim=-1)
    assert torch.allclose(norms[::2], torch.ones_like(norms[::2]), atol=1e-5)
    assert not torch.allclose(norms[1::2], torch.ones_like(norms[1::2]), atol=1e-2)


def test_a_bad_prompt_in_a_later_part_raises_and_the_engine_serves_on(
    llm_fp32: LLM, in_parts: list[int]
) -> None:
    limit = llm_fp32.config.model.max_model_len
    texts = [*TEXTS[:9], "word " * (limit + 50), *TEXTS[9:]]
    with pytest.raises(InvalidInputError, match=r"prompt 9 .*\b" + str(limit)):
        llm_fp32.embed(texts, truncate_prompt_tokens=None, use_tqdm=False)
    assert not llm_fp32.engine.has_unfinished_requests(), "requests of earlier parts left behind"
    assert llm_fp32.client.num_unfinished == 0
    again = llm_fp32.embed(TEXTS, use_tqdm=False)
    assert len(again) == len(TEXTS)
