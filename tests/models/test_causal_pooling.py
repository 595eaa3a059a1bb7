"""Causal models as embedders: LAST by default, MEAN and CLS through ``pooler_config``, correct
when the prompt is split into chunks across steps (the runner accumulates the hidden states)."""

from __future__ import annotations

import pytest
import torch
from factories.decoders import make_decoder
from factories.generation import make_llm, random_prompts, token_prompts

from cenote import PoolingParams

ATOL = 1e-4
PROMPTS = random_prompts([9, 23, 5, 17], seed=41)
RAW = PoolingParams(normalize=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("llama_pool")
    return folder, make_decoder(folder, "llama")


def _hidden(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    torch.set_num_threads(2)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()  # [prompt_len, hidden], after the final norm


@pytest.mark.parametrize(
    ("pooling_type", "reduce"),
    [("MEAN", lambda h: h.mean(0)), ("CLS", lambda h: h[0]), ("LAST", lambda h: h[-1])],
)
@pytest.mark.parametrize("budget", [None, 8])  # 8: prompts split into chunks over several steps
def test_pooling_type_matches_transformers(tiny, pooling_type, reduce, budget) -> None:
    folder, theirs = tiny
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = make_llm(folder, pooler_config={"pooling_type": pooling_type}, **kwargs)
    outputs = llm.embed(token_prompts(PROMPTS), RAW, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = reduce(_hidden(theirs, prompt))
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)
    assert not llm.engine.has_unfinished_requests()


def test_normalize_default_from_pooler_config(tiny) -> None:
    folder, theirs = tiny
    llm = make_llm(folder, pooler_config={"normalize": False})
    out = llm.embed(token_prompts(PROMPTS[:1]), use_tqdm=False)[0]
    torch.testing.assert_close(out.outputs.data, _hidden(theirs, PROMPTS[0])[-1], atol=ATOL, rtol=0)


def test_mean_pooling_does_not_reuse_the_prefix_cache(tiny) -> None:
    """MEAN must see every token's hidden state: a repeated prompt is computed again."""
    folder, theirs = tiny
    llm = make_llm(folder, pooler_config={"pooling_type": "MEAN"}, block_size=4)
    first = llm.embed(token_prompts(PROMPTS[1:2]), RAW, use_tqdm=False)[0]
    second = llm.embed(token_prompts(PROMPTS[1:2]), RAW, use_tqdm=False)[0]
    assert llm.engine.kv_cache_manager.hits == 0
    torch.testing.assert_close(first.outputs.data, second.outputs.data, atol=1e-6, rtol=0)


def test_bad_pooler_config() -> None:
    from cenote.config import PoolerConfig

    with pytest.raises(ValueError, match="pooling_type must be one of CLS, MEAN, LAST"):
        PoolerConfig(pooling_type="MAX")
    with pytest.raises(ValueError, match="unknown pooler_config keys"):
        PoolerConfig.of({"pooling": "MEAN"})
