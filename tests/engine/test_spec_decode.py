"""Speculative decoding (n-gram prompt lookup): the proposer, the pacing, the verifier's output
distribution, and the engine's outputs against plain decoding (greedy: token for token)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from factories.decoders import make_byte_level_decoder, make_decoder
from factories.generation import (
    assert_same_completions,
    make_llm,
    random_prompts,
    record_steps,
    smollm2_path,
    token_prompts,
)

from cenote import SamplingParams
from cenote.config import SpeculativeConfig
from cenote.engine_args import EngineArgs
from cenote.messages import SchedulerStats
from cenote.sampling.metadata import SamplingMetadata, SamplingRow
from cenote.server.metrics import ServerMetrics
from cenote.spec_decode.ngram import NgramProposer
from cenote.spec_decode.pacing import DraftPacing
from cenote.spec_decode.verifier import verify_drafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
MAX_NEW = 40
LOGPROB_ATOL = 1e-5  # DESIGN.md: batch invariance in fp32
# repeated text: the model's continuation quotes it, so drafts get accepted
PROMPTS = [p * 3 for p in random_prompts([12, 7, 20], seed=3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)


# ---- the proposer and the pacing ------------------------------------------------------------


def _proposer(low: int = 2, high: int = 4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(prompt_lookup_min=low, prompt_lookup_max=high))


def test_proposer_takes_the_longest_suffix_then_its_latest_match() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11 12 13
    tokens = [5, 1, 2, 3, 8, 9, 2, 3, 6, 7, 1, 2, 3]
    # the 3-token suffix [1, 2, 3] occurs at 1 (followed by 8, 9, 2, 3 ...)
    assert _proposer().propose(tokens, 3) == [8, 9, 2]
    # only 2-token suffixes: [2, 3] occurs at 2 and 6; the latest (6) is followed by 6, 7
    assert _proposer(2, 2).propose(tokens, 2) == [6, 7]
    # near the end of the sequence fewer tokens follow than asked
    assert _proposer(2, 2).propose([4, 2, 3, 9, 2, 3], 5) == [9, 2, 3]


def test_proposer_without_a_match_proposes_nothing() -> None:
    assert _proposer().propose([1, 2, 3, 4, 5, 6], 4) == []
    assert _proposer().propose([1, 2, 1, 2], 0) == []
    assert _proposer(3, 4).propose([7, 7, 7], 4) == []  # shorter than a suffix plus one
    # a 1-token match is below prompt_lookup_min 2
    assert _proposer(2, 3).propose([1, 9, 4, 1], 2) == []
    assert _proposer(1, 3).propose([1, 9, 4, 1], 2) == [9, 4]


def test_pacing_shrinks_pauses_and_recovers() -> None:
    pacing = DraftPacing(4)
    assert pacing.next_length() == 4
    pacing.record(4, 4)
    assert pacing.next_length() == 4
    pacing.record(4, 1)  # one kept: draft one past it
    assert pacing.next_length() == 2
    pacing.record(2, 0)  # nothing kept: pause 2 steps, then probe with one token
    assert [pacing.next_length() for _ in range(3)] == [0, 0, 1]
    pacing.record(1, 0)  # a second miss in a row: pause 4 steps
    assert [pacing.next_length() for _ in range(5)] == [0, 0, 0, 0, 1]
    pacing.record(1, 1)  # accepted: back to the full length
    assert pacing.next_length() == 4
    for _ in range(10):  # the pause is bounded
        pacing.record(1, 0)
    assert pacing.num_paused_steps == 32


# ---- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle"}, "method 'eagle' is not supported; supported: ngram"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a "),
        ({"method": "ngram", "num_speculative_tokens": -2}, "got -2"),
        (
            {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "prompt_lookup_min (5) is above prompt_lookup_max (3)",
        ),
        ({"method": "ngram", "lookahead": 3}, "unknown speculative_config keys ['lookahead']"),
        ({"num_speculative_tokens": 3}, "speculative_config needs a method"),
    ],
)
def test_bad_config_is_refused_with_the_numbers(config: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        SpeculativeConfig.of(config)
    assert message in str(error.value)


def test_config_defaults_follow_vllm() -> None:
    only_max = SpeculativeConfig.of({"method": "ngram", "prompt_lookup_max": 3})
    assert only_max is not None and only_max.prompt_lookup_min == 3
    only_min = SpeculativeConfig.of({"method": "ngram", "prompt_lookup_min": 3})
    assert only_min is not None and only_min.prompt_lookup_max == 3
    assert SpeculativeConfig.of({"method": "ngram"}) == SpeculativeConfig()


def test_bad_config_on_the_command_line_fails_at_start(folder) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    flag = '{"method": "ngram", "prompt_lookup_min": 9, "prompt_lookup_max": 3}'
    args = parser.parse_args([str(folder), "--speculative-config", flag])
    assert args.speculative_config["prompt_lookup_min"] == 9
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(9\) is above prompt_lookup_max"):
        EngineArgs.from_cli_args(args).create_engine_config()


def test_a_model_that_does_not_generate_is_refused() -> None:
    with pytest.raises(ValueError, match="speculative_config needs a model that generates"):
        EngineArgs(None, speculative_config={"method": "ngram"}).create_engine_config()


# ---- the verifier: exact rejection sampling -------------------------------------------------


def _metadata(params: SamplingParams, outputs: list[list[int]], seed: int | None = None):
    rows = [SamplingRow(params, [0], list(o)) for o in outputs]
    metadata = SamplingMetadata.from_rows(rows, vocab_size=6)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        metadata.generators = dict.fromkeys(range(len(rows)), generator)
    return metadata


def _target(params: SamplingParams, logits: torch.Tensor, output: list[int]) -> torch.Tensor:
    """The distribution plain sampling draws from after ``output`` (the sampler's own code)."""
    from cenote.sampling.sampler import adjust_logits, sampling_probs

    metadata = _metadata(params, [output])
    return sampling_probs(adjust_logits(logits.clone().unsqueeze(0), metadata), metadata)[0]


def _assert_frequencies(samples: list[int], probs: torch.Tensor) -> None:
    """Every token's count within 5 standard deviations of its expectation (and never a token
    of probability 0)."""
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    for token, p in enumerate(probs.double().tolist()):
        if p == 0.0:
            assert counts[token] == 0, (token, counts)
            continue
        bound = 5 * math.sqrt(n * p * (1 - p)) + 1
        assert abs(counts[token] - n * p) <= bound, (token, counts.tolist(), [n * q for q in probs])


@pytest.mark.parametrize("draft", [1, 4, 5])  # likely, unlikely, cut by top_k
def test_rejection_sampling_keeps_the_distribution(draft: int) -> None:
    """Many requests with the same logits and a one-token draft: the first emitted token is
    distributed as plain sampling's p_0 whatever the draft; the second, after an accepted
    draft, as p_1 given the draft in the output (a presence penalty makes them differ)."""
    num = 4000
    logits0 = torch.tensor([0.5, 2.0, 1.0, -1.0, 0.2, -3.0])
    logits1 = torch.tensor([1.5, 1.2, -0.5, 0.3, 0.9, 0.0])
    params = SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.7)
    logits = torch.stack([logits0, logits1]).repeat(num, 1)  # [2 num, vocab]
    outputs = [[3], [3, draft]] * num
    verified = verify_drafts(logits, _metadata(params, outputs, seed=11), [[draft]] * num)
    first = [tokens[0] for tokens in verified.token_ids]
    _assert_frequencies(first, _target(params, logits0, [3]))
    seconds = [tokens[1] for tokens in verified.token_ids if len(tokens) == 2]
    assert all(tokens[0] == draft for tokens in verified.token_ids if len(tokens) == 2)
    p_draft = _target(params, logits0, [3])[draft].item()
    assert abs(len(seconds) - num * p_draft) <= 5 * math.sqrt(num * p_draft * (1 - p_draft)) + 1
    if seconds:
        _assert_frequencies(seconds, _target(params, logits1, [3, draft]))


def test_rejection_sampling_is_seeded() -> None:
    logits = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=5)
    drafts = [[1, 2, 3], [4, 0, 2]]
    outputs = [[], [1], [1, 2], [1, 2, 3], [], [4], [4, 0], [4, 0, 2]]
    first = verify_drafts(logits, _metadata(params, outputs, seed=5), drafts).token_ids
    again = verify_drafts(logits, _metadata(params, outputs, seed=5), drafts).token_ids
    assert first == again


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax() -> None:
    logits = torch.full((6, 6), -1.0)
    for row, token in enumerate([2, 4, 1, 5, 5, 0]):
        logits[row, token] = 1.0  # row r's argmax
    params = SamplingParams(temperature=0.0)
    drafts = [[2, 4, 0], [5]]  # the first request: third draft wrong; the second: all right
    verified = verify_drafts(logits, _metadata(params, [[]] * 6), drafts)
    assert verified.token_ids == [[2, 4, 1], [5, 0]]


# ---- the engine: tiny Llama -----------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("llama")
    make_decoder(folder, "llama")
    return folder


@pytest.fixture(scope="module")
def plain(folder):
    return make_llm(folder, block_size=4)


@pytest.fixture(scope="module")
def spec(folder):
    return make_llm(folder, block_size=4, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def reference(plain) -> list:
    return [o.outputs[0] for o in plain.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)]


def _num_drafts(steps) -> int:
    return sum(len(s.draft_token_ids) for step in steps for s in step.scheduled)


def test_greedy_is_token_identical_alone(spec, reference) -> None:
    before = spec.spec_decode_metrics()
    for prompt, ref in zip(PROMPTS, reference, strict=True):
        steps = record_steps(spec)
        (out,) = spec.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)
        assert_same_completions([out.outputs[0]], [ref], LOGPROB_ATOL)
        assert len(steps) < MAX_NEW  # drafts were accepted: fewer steps than tokens
    metrics = spec.spec_decode_metrics()
    assert metrics.num_draft_tokens > before.num_draft_tokens
    assert 0 < metrics.num_accepted_tokens - before.num_accepted_tokens
    assert metrics.num_accepted_tokens <= metrics.num_draft_tokens
    assert 0.0 < metrics.acceptance_rate <= 1.0
    assert not spec.engine.has_unfinished_requests()
    assert spec.engine.kv_cache_manager.usage == 0.0


def test_greedy_is_token_identical_batched_with_prefills_and_sampling(folder, reference) -> None:
    """A small token budget: prompts are chunked across steps in which other requests verify
    drafts; a sampled request without speculation-specific settings shares the steps."""
    llm = make_llm(folder, block_size=4, max_num_batched_tokens=24, speculative_config=NGRAM)
    steps = record_steps(llm)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=MAX_NEW)
    prompts = [*PROMPTS, PROMPTS[0][:9]]
    outs = llm.generate(token_prompts(prompts), [GREEDY, GREEDY, GREEDY, sampled], use_tqdm=False)
    assert_same_completions([o.outputs[0] for o in outs[:3]], reference, LOGPROB_ATOL)
    assert len(outs[3].outputs[0].token_ids) == MAX_NEW
    mixed = [
        step
        for step in steps
        if any(s.draft_token_ids for s in step.scheduled)
        and any(not s.needs_sample for s in step.scheduled)
    ]
    assert mixed, "no step verified drafts next to a prompt chunk"


def test_pooling_rows_share_a_step_with_drafts(folder) -> None:
    """A causal LM embeds (last token) and generates in one engine: drafted decode rows and
    pooled prompts run in the same step, and each result equals its separate run."""
    from cenote import PoolingParams

    raw = PoolingParams(normalize=False)
    embed_prompts = random_prompts([9, 15], seed=32)
    alone = make_llm(folder, block_size=4)
    if "embed" not in alone.supported_tasks:
        pytest.skip("this causal LM does not serve embed")
    ref_embeds = alone.embed(token_prompts(embed_prompts), raw, use_tqdm=False)
    llm = make_llm(folder, block_size=4, speculative_config=NGRAM)
    steps = record_steps(llm)
    gen_ids = [f"gen-{i}" for i in range(len(PROMPTS))]
    llm.client.add(llm.input_processor.process_batch(gen_ids, token_prompts(PROMPTS), GREEDY))
    for _ in range(6):  # until the generations verify drafts
        llm.client.outputs()
    emb_ids = ["emb-0", "emb-1"]
    requests = llm.input_processor.process_batch(
        emb_ids, token_prompts(embed_prompts), raw.with_task("embed")
    )
    llm.client.add(requests)
    finished = {o.request_id: o for o in llm.client.outputs() if o.finished}
    mixed = steps[-1]
    assert any(s.draft_token_ids for s in mixed.scheduled)
    assert any(s.pooling_params is not None for s in mixed.scheduled)
    for request_id, ref in zip(emb_ids, ref_embeds, strict=True):
        torch.testing.assert_close(
            finished[request_id].outputs.data, ref.outputs.data, atol=1e-5, rtol=0
        )


def test_max_tokens_and_stop_tokens_end_mid_draft(spec, reference) -> None:
    ref = reference[0]
    for max_tokens in (5, 11, 17):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        (out,) = spec.generate(token_prompts(PROMPTS[:1]), params, use_tqdm=False)
        assert out.outputs[0].token_ids == ref.token_ids[:max_tokens]
        assert out.outputs[0].finish_reason == "length"
    for at in (6, 13):
        stop_id = ref.token_ids[at]
        first = ref.token_ids.index(stop_id)
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop_id]
        )
        (out,) = spec.generate(token_prompts(PROMPTS[:1]), params, use_tqdm=False)
        assert out.outputs[0].token_ids == ref.token_ids[: first + 1]
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].stop_reason == stop_id
    assert not spec.engine.has_unfinished_requests()


def _stop_inside_a_draft(steps, prompt_len: int, token_ids: list[int]) -> tuple[str, int]:
    """A stop string and the output index of the token that completes it, where that token
    arrives as an accepted draft token with more tokens after it in the same step: the last
    words of the text up to that token, as many as make their first occurrence end there."""
    text = "".join(f" w{t}" for t in token_ids)  # the generation tokenizer's text
    for step in steps:
        (s,) = step.scheduled
        for j, draft in enumerate(s.draft_token_ids):
            index = s.start_position + 1 + j - prompt_len
            if index >= len(token_ids) or token_ids[index] != draft:
                break  # rejected: the rest of the draft too
            end = len("".join(f" w{t}" for t in token_ids[: index + 1]))
            for num_words in range(1, index + 1):
                stop = "".join(f" w{t}" for t in token_ids[index + 1 - num_words : index + 1])
                if text.find(stop) + len(stop) == end and not text[end:].startswith(
                    tuple("0123456789")
                ):
                    return stop.strip(), index
    raise AssertionError("no draft token accepted mid-step")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_mid_draft(spec, plain, include: bool) -> None:
    """The stop string's last token arrives inside a verified draft, tokens after it in the
    same step: none of them is kept."""
    prompt = PROMPTS[0]
    steps = record_steps(spec)
    (ref,) = spec.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)
    token_ids = ref.outputs[0].token_ids
    assert ref.outputs[0].text == "".join(f" w{t}" for t in token_ids)
    stop, index = _stop_inside_a_draft(steps, len(prompt), token_ids)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=include,
        logprobs=1,
    )
    (expected,) = plain.generate(token_prompts([prompt]), params, use_tqdm=False)
    (out,) = spec.generate(token_prompts([prompt]), params, use_tqdm=False)
    got, want = out.outputs[0], expected.outputs[0]
    assert got.text == want.text and got.token_ids == want.token_ids
    assert got.token_ids == token_ids[: index + 1]
    assert len(got.logprobs) == len(got.token_ids)
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert not spec.engine.has_unfinished_requests()


def test_seeded_sampling_is_reproducible_and_penalties_apply(spec) -> None:
    params = SamplingParams(
        temperature=0.7, top_k=20, seed=9, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1,
        repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, min_tokens=5,
        logit_bias={7: 2.0},
    )  # fmt: skip
    (first,) = spec.generate(token_prompts(PROMPTS[:1]), params, use_tqdm=False)
    (again,) = spec.generate(token_prompts(PROMPTS[:1]), params, use_tqdm=False)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    assert len(first.outputs[0].token_ids) == MAX_NEW
    assert len(first.outputs[0].logprobs) == MAX_NEW


def test_structured_outputs_are_not_drafted_for(tmp_path) -> None:
    """A constrained request decodes one token a step beside a drafting one in the same steps."""
    from cenote import StructuredOutputsParams

    make_byte_level_decoder(tmp_path, "llama", seed=5)
    llm = make_llm(tmp_path, block_size=4, speculative_config=NGRAM)
    prompt = list(range(40, 60)) * 3  # printable ASCII bytes of the byte-level vocabulary
    choices = ["alpha beta gamma", "delta epsilon"]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    steps = record_steps(llm)
    outs = llm.generate(token_prompts([prompt, prompt]), [constrained, free], use_tqdm=False)
    assert outs[0].outputs[0].text in choices
    drafted = {s.request_id for step in steps for s in step.scheduled if s.draft_token_ids}
    assert drafted == {outs[1].request_id}


def test_server_metrics_count_drafts() -> None:
    metrics = ServerMetrics("tiny")
    metrics.record_step(
        SchedulerStats(
            num_running=1, num_waiting=0, num_scheduled_tokens=5, num_draft_tokens=4,
            num_accepted_tokens=3,
        ),
        [],
    )  # fmt: skip
    text = metrics.families.render().decode()
    assert 'cenote_spec_decode_num_draft_tokens_total{model_name="tiny"} 4.0' in text
    assert 'cenote_spec_decode_num_accepted_tokens_total{model_name="tiny"} 3.0' in text


# ---- the real SmolLM2 -----------------------------------------------------------------------

SMOLLM2_TEXT = (
    "Context: The Amazon river carries more water than the next seven largest rivers "
    "combined. It flows through Peru, Colombia and Brazil before it reaches the Atlantic.\n"
    "Question: Quote the context word for word.\nAnswer: The Amazon river carries"
)


def test_smollm2_greedy_is_token_identical() -> None:
    """The real GGUF (quantized weights): a prompt whose answer quotes its context, greedy,
    with and without speculation; drafts are accepted and the tokens are the same."""
    from cenote import LLM

    path = smollm2_path()
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=1)
    plain = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    (want,) = plain.generate([SMOLLM2_TEXT], params, use_tqdm=False)
    del plain
    spec = LLM(str(path), dtype="float32", enable_prefix_caching=False, speculative_config=NGRAM)
    (got,) = spec.generate([SMOLLM2_TEXT], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].text == want.outputs[0].text
    for x, y in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert x.keys() == y.keys()
    assert spec.spec_decode_metrics().num_accepted_tokens > 0
