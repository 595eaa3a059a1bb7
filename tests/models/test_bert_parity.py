"""BERT / RoBERTa / XLM-R encoders vs transformers on tiny random models, fp32, atol 1e-4.

CLS / MEAN / LAST come from sentence-transformers metadata written into the model folder
(no Normalize); ALL is ``encode(pooling_task="token_embed")`` with ``normalize=False``. The
reference is transformers' ``last_hidden_state`` of each prompt run alone, pooled by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_THREADS
from factories.encoders import ENCODER_FAMILIES, TINY_MAX_POSITIONS, make_encoder
from factories.st_folders import ST_POOLING_MODES, with_st_pooling
from factories.texts import random_prompts

from cenote import LLM, PoolingParams

ATOL = 1e-4  # DESIGN.md §3


def _lengths(family: str) -> list[int]:
    """Mixed lengths, two equal ones (they share an attention call), one at the model's limit.

    RoBERTa positions start at padding_idx + 1 = 2, so its limit is 126 and an off-by-N in the
    position ids shifts every token of these prompts onto another (random) embedding row.
    """
    limit = TINY_MAX_POSITIONS - (2 if family != "bert" else 0)
    return [1, 5, 37, 37, 64, 100, limit]


class Family:
    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.path = root / "model"
        self.reference = make_encoder(self.path, name, seed=len(name))
        self.prompts = random_prompts(_lengths(name), seed=1)
        self._hidden: list[torch.Tensor] | None = None

    def hidden(self) -> list[torch.Tensor]:
        """transformers' last_hidden_state of each prompt alone: [len, hidden] each."""
        if self._hidden is None:
            with torch.no_grad():
                self._hidden = [
                    self.reference(input_ids=torch.tensor([p])).last_hidden_state[0]
                    for p in self.prompts
                ]
        return self._hidden


@pytest.fixture(scope="module", params=sorted(ENCODER_FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(request.param))


def _token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def test_max_model_len_accounts_for_position_offset(family: Family) -> None:
    llm = LLM(str(family.path), dtype="float32", num_threads=NUM_THREADS)
    assert llm.config.model.max_model_len == max(_lengths(family.name))
    assert llm.config.model.architecture == ENCODER_FAMILIES[family.name][0] + "Model"


def test_all_tokens_match_last_hidden_state(family: Family) -> None:
    llm = LLM(str(family.path), dtype="float32", num_threads=NUM_THREADS)
    outputs = llm.encode(
        _token_prompts(family.prompts),
        PoolingParams(normalize=False),
        pooling_task="token_embed",
    )
    for out, prompt, expected in zip(outputs, family.prompts, family.hidden(), strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs.data.shape == expected.shape
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def _hand_pool(hidden: torch.Tensor, method: str) -> torch.Tensor:
    if method == "cls":
        return hidden[0]
    if method == "mean":
        return hidden.mean(dim=0)
    assert method == "last"
    return hidden[-1]


@pytest.mark.parametrize("method", sorted(ST_POOLING_MODES))
def test_sequence_pooling_matches_hand_pooled(family: Family, method: str, tmp_path: Path) -> None:
    folder = with_st_pooling(family.path, tmp_path / f"{family.name}-{method}", method)
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    outputs = llm.embed(_token_prompts(family.prompts))
    for out, hidden in zip(outputs, family.hidden(), strict=True):
        expected = _hand_pool(hidden, method)
        # no Normalize module in the folder: the raw pooled vector comes back
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_normalize_module_and_default_pooling(family: Family, tmp_path: Path) -> None:
    """With a Normalize module the pooled vector is L2-normalized; without any
    sentence-transformers metadata, an encoder embeds with normalized CLS (as vLLM)."""
    folder = with_st_pooling(family.path, tmp_path / "mean-norm", "mean", normalize=True)
    for path, method in ((folder, "mean"), (family.path, "cls")):
        llm = LLM(str(path), dtype="float32", num_threads=NUM_THREADS)
        outputs = llm.embed(_token_prompts(family.prompts[:4]))
        for out, hidden in zip(outputs, family.hidden()[:4], strict=True):
            expected = F.normalize(_hand_pool(hidden, method), dim=-1)
            torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_text_prompts_use_the_folder_tokenizer(family: Family) -> None:
    llm = LLM(str(family.path), dtype="float32", num_threads=NUM_THREADS)
    (out,) = llm.encode("w7 w8 w9", PoolingParams(normalize=False), pooling_task="token_embed")
    specials = ENCODER_FAMILIES[family.name][2]
    cls_id, sep_id = (2, 3) if specials[0] == "[PAD]" else (0, 2)
    assert out.prompt_token_ids == [cls_id, 7, 8, 9, sep_id]
    with torch.no_grad():
        expected = family.reference(input_ids=torch.tensor([out.prompt_token_ids]))
    torch.testing.assert_close(out.outputs.data, expected.last_hidden_state[0], atol=ATOL, rtol=0)
