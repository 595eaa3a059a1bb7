"""One causal model serves generate and embed requests in the same engine steps; every result
equals the one from a separate run, and last-token embeddings match transformers."""

from __future__ import annotations

import pytest
import torch
from factories.decoders import DECODER_FAMILIES, make_decoder
from factories.generation import make_llm, random_prompts, record_steps, token_prompts

from cenote import PoolingParams, SamplingParams

ATOL = 1e-4
LOGPROB_ATOL = 1e-5
GEN_PROMPTS = random_prompts([7, 12, 5], seed=31)
EMBED_PROMPTS = random_prompts([9, 3, 15, 6], seed=32)
GEN_PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
RAW = PoolingParams(normalize=False)


@pytest.fixture(scope="module", params=sorted(DECODER_FAMILIES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    theirs = make_decoder(folder, request.param)
    return folder, theirs


@pytest.fixture(scope="module")
def separate(tiny):
    """Each kind alone: (generation outputs, embedding outputs)."""
    folder, _ = tiny
    llm = make_llm(folder, block_size=4)
    gens = llm.generate(token_prompts(GEN_PROMPTS), GEN_PARAMS, use_tqdm=False)
    embeds = llm.embed(token_prompts(EMBED_PROMPTS), RAW, use_tqdm=False)
    default = llm.embed(token_prompts(EMBED_PROMPTS[:1]), use_tqdm=False)
    return gens, embeds, default


def _add(llm, kind: str, prompts: list[list[int]], params) -> list[str]:
    """Process prompts and add them to the engine through the LLM's own client."""
    ids = [f"{kind}-{i}" for i in range(len(prompts))]
    requests = llm.input_processor.process_batch(ids, token_prompts(prompts), params)
    llm.client.add(requests)
    return ids


def _kinds(step) -> tuple[bool, bool]:
    """(has a generation row, has a pooling row) in one SchedulerOutput."""
    return (
        any(s.sampling_params is not None for s in step.scheduled),
        any(s.pooling_params is not None for s in step.scheduled),
    )


def _assert_same(gens, embeds, separate) -> None:
    ref_gens, ref_embeds, _ = separate
    for out, ref in zip(gens, ref_gens, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].text == ref.outputs[0].text
        for x, y in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) <= LOGPROB_ATOL for t in x)
    for out, ref in zip(embeds, ref_embeds, strict=True):
        torch.testing.assert_close(out.outputs.data, ref.outputs.data, atol=1e-5, rtol=0)


def test_embeddings_match_transformers_last_hidden_state(tiny, separate) -> None:
    _, theirs = tiny
    _, embeds, default = separate
    torch.set_num_threads(2)
    for prompt, out in zip(EMBED_PROMPTS, embeds, strict=True):
        with torch.no_grad():
            hidden = theirs(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        expected = hidden[-1][0, -1].float()  # last layer, after the final norm, last token
        assert out.outputs.data.shape == expected.shape
        torch.testing.assert_close(out.outputs.data.float(), expected, atol=ATOL, rtol=0)
    # the default (normalize=None) is L2-normalized for a causal LM without ST metadata
    expected = torch.nn.functional.normalize(embeds[0].outputs.data.float(), dim=-1)
    torch.testing.assert_close(default[0].outputs.data.float(), expected, atol=1e-6, rtol=0)


def test_prefills_of_both_kinds_share_a_step(tiny, separate) -> None:
    folder, _ = tiny
    llm = make_llm(folder, block_size=4, enable_prefix_caching=False)
    steps = record_steps(llm)
    gen_ids = _add(llm, "gen", GEN_PROMPTS, GEN_PARAMS)
    emb_ids = _add(llm, "emb", EMBED_PROMPTS, RAW.with_task("embed"))
    outputs = llm.client.wait(gen_ids + emb_ids)
    gens, embeds = outputs[: len(gen_ids)], outputs[len(gen_ids) :]
    assert _kinds(steps[0]) == (True, True)
    assert steps[0].total_num_scheduled_tokens == sum(map(len, GEN_PROMPTS + EMBED_PROMPTS))
    _assert_same(gens, embeds, separate)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.usage == 0.0


def test_embeddings_join_running_decodes(tiny, separate) -> None:
    """Embedding prompts arrive while generations decode: decode rows and pooling prefills run
    in the same step."""
    folder, _ = tiny
    llm = make_llm(folder, block_size=4)
    steps = record_steps(llm)
    gen_ids = _add(llm, "gen", GEN_PROMPTS, GEN_PARAMS)
    llm.client.outputs()  # prefill + first token
    llm.client.outputs()  # a decode step
    emb_ids = _add(llm, "emb", EMBED_PROMPTS, RAW.with_task("embed"))
    finished = {out.request_id: out for out in llm.client.outputs() if out.finished}
    mixed = steps[-1]
    decodes = [s for s in mixed.scheduled if s.sampling_params is not None]
    pools = [s for s in mixed.scheduled if s.pooling_params is not None]
    assert len(decodes) == len(GEN_PROMPTS) and all(s.num_tokens == 1 for s in decodes)
    assert len(pools) == len(EMBED_PROMPTS) and all(s.completes_prompt for s in pools)
    embeds = [finished[i] for i in emb_ids]  # pooled in the mixed step
    gens = llm.client.wait(gen_ids)
    _assert_same(gens, embeds, separate)


def test_chunked_embeddings_next_to_decodes(tiny, separate) -> None:
    """A small token budget: embedding prompts are split across steps that also decode."""
    folder, _ = tiny
    llm = make_llm(folder, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False)
    steps = record_steps(llm)
    gen_ids = _add(llm, "gen", GEN_PROMPTS, GEN_PARAMS)
    emb_ids = _add(llm, "emb", EMBED_PROMPTS, RAW.with_task("embed"))
    outputs = llm.client.wait(gen_ids + emb_ids)
    gens, embeds = outputs[: len(gen_ids)], outputs[len(gen_ids) :]
    assert any(
        any(s.sampling_params is not None and s.needs_sample for s in step.scheduled)
        and any(s.pooling_params is not None for s in step.scheduled)
        for step in steps
    )
    assert any(
        s.pooling_params is not None and not s.completes_prompt
        for step in steps
        for s in step.scheduled
    )  # an embedding prompt was split
    _assert_same(gens, embeds, separate)


def test_generate_then_embed_through_the_public_api(tiny, separate) -> None:
    """The public calls on one engine, alternating, with the prefix cache warm from each other."""
    folder, _ = tiny
    llm = make_llm(folder, block_size=4)
    shared = EMBED_PROMPTS[2]  # 15 tokens: an embedding and a generation share its blocks
    (gen_first,) = llm.generate(token_prompts([shared]), GEN_PARAMS, use_tqdm=False)
    (emb,) = llm.embed(token_prompts([shared]), RAW, use_tqdm=False)
    torch.testing.assert_close(emb.outputs.data, separate[1][2].outputs.data, atol=1e-5, rtol=0)
    (gen_again,) = llm.generate(token_prompts([shared]), GEN_PARAMS, use_tqdm=False)
    assert gen_again.num_cached_tokens > 0
    assert gen_again.outputs[0].token_ids == gen_first.outputs[0].token_ids
    _assert_same(
        llm.generate(token_prompts(GEN_PROMPTS), GEN_PARAMS, use_tqdm=False),
        llm.embed(token_prompts(EMBED_PROMPTS), RAW, use_tqdm=False),
        separate,
    )
