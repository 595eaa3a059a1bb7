"""Speculative decoding with a draft model: the target as its own draft (greedy drafts all
accepted) and a smaller random draft of the same vocabulary (most drafts rejected), against
plain decoding (greedy: token for token, logprobs 1e-5 in fp32) and against transformers'
distribution (sampling); the draft's cache across steps; bad configurations."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from factories.decoders import make_decoder
from factories.encoders import make_encoder
from factories.generation import (
    assert_same_completions,
    make_llm,
    random_prompts,
    record_steps,
    token_prompts,
)

from cenote import SamplingParams
from cenote.config import SpeculativeConfig
from cenote.engine_args import EngineArgs
from cenote.spec_decode.proposer import DraftQuery

MAX_NEW = 40
LOGPROB_ATOL = 1e-5  # DESIGN.md: batch invariance in fp32
PROMPTS = random_prompts([12, 7, 20], seed=3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
SMALL_DRAFT = dict(
    seed=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip


def _spec(draft, k: int = 3) -> dict:
    return {"model": str(draft), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    """(target folder, small draft folder, the target's transformers model)."""
    root = tmp_path_factory.mktemp("draft")
    hf_target = make_decoder(root / "target", "llama")
    make_decoder(root / "small", "llama", **SMALL_DRAFT)
    return root / "target", root / "small", hf_target


@pytest.fixture(scope="module")
def reference(models) -> list:
    target, _, _ = models
    plain = make_llm(target, block_size=4)
    return [o.outputs[0] for o in plain.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def small_spec(models):
    target, small, _ = models
    return make_llm(target, block_size=4, speculative_config=_spec(small))


def _assert_draft_cache_empty(llm) -> None:
    proposer = llm.engine.scheduler.proposer
    assert proposer.sequences == {}
    assert proposer.kv_cache_manager.usage == 0.0


# ---- greedy: token for token ----------------------------------------------------------------


def test_target_as_its_own_draft_is_accepted_and_identical(models, reference) -> None:
    target, _, _ = models
    llm = make_llm(target, block_size=4, speculative_config=_spec(target))
    steps = record_steps(llm)
    outs = llm.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)
    assert_same_completions([o.outputs[0] for o in outs], reference, LOGPROB_ATOL, check_text=False)
    metrics = llm.spec_decode_metrics()
    assert metrics.num_draft_tokens > MAX_NEW
    assert metrics.acceptance_rate >= 0.95  # the same weights: only fp32 near-ties may differ
    assert len(steps) < MAX_NEW  # 3 prompts x 40 tokens in far fewer steps
    _assert_draft_cache_empty(llm)
    assert llm.engine.kv_cache_manager.usage == 0.0


def test_small_draft_is_identical_alone(small_spec, reference) -> None:
    before = small_spec.spec_decode_metrics()
    for prompt, ref in zip(PROMPTS, reference, strict=True):
        (out,) = small_spec.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)
        assert_same_completions([out.outputs[0]], [ref], LOGPROB_ATOL, check_text=False)
    metrics = small_spec.spec_decode_metrics()
    assert metrics.num_draft_tokens > before.num_draft_tokens  # drafted, mostly rejected
    _assert_draft_cache_empty(small_spec)


def test_identical_batched_with_chunked_prompts_and_sampling(models, reference) -> None:
    """A budget of 24 tokens: prompts are chunked across steps in which other requests verify
    drafts (the draft catches up on a whole prompt in chunks of the budget too); a sampled
    request shares the steps."""
    target, _, _ = models
    llm = make_llm(
        target, block_size=4, max_num_batched_tokens=24, speculative_config=_spec(target, k=4)
    )
    steps = record_steps(llm)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=MAX_NEW)
    long_prompt = random_prompts([60], seed=8)[0]  # three budgets: a chunked draft catch-up
    prompts = [*PROMPTS, long_prompt]
    params = [GREEDY, GREEDY, GREEDY, sampled]
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert_same_completions(
        [o.outputs[0] for o in outs[:3]], reference, LOGPROB_ATOL, check_text=False
    )
    assert len(outs[3].outputs[0].token_ids) == MAX_NEW
    mixed = [
        step
        for step in steps
        if any(s.draft_token_ids for s in step.scheduled)
        and any(not s.needs_sample for s in step.scheduled)
    ]
    assert mixed, "no step verified drafts next to a prompt chunk"
    assert any(
        s.draft_token_ids and s.sampling_params.temperature > 0
        for st in steps
        for s in st.scheduled
    )
    _assert_draft_cache_empty(llm)


def test_preemption_and_abort_free_the_draft_cache(models, reference) -> None:
    """A target cache of 24 blocks of 4 tokens for three requests of up to 60 tokens: requests
    are preempted and recomputed, and their drafts restart from nothing. An aborted request's
    draft cache is freed."""
    target, small, _ = models
    llm = make_llm(
        target, block_size=4, num_gpu_blocks_override=24, max_model_len=64,
        speculative_config=_spec(small),
    )  # fmt: skip
    steps = record_steps(llm)
    outs = llm.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)
    assert_same_completions([o.outputs[0] for o in outs], reference, LOGPROB_ATOL, check_text=False)
    assert any(step.preempted_request_ids for step in steps)
    _assert_draft_cache_empty(llm)
    ids = ["a", "b"]
    llm.client.add(llm.input_processor.process_batch(ids, token_prompts(PROMPTS[:2]), GREEDY))
    for _ in range(4):  # prompts, then drafted steps
        llm.client.outputs()
    assert set(llm.engine.scheduler.proposer.sequences) == set(ids)
    llm.client.abort(ids)
    llm.client.outputs()
    _assert_draft_cache_empty(llm)
    assert not llm.engine.has_unfinished_requests()


# ---- the proposer: catch-up and roll-back ---------------------------------------------------


def test_a_failing_draft_model_turns_speculation_off_not_the_engine(
    models, reference, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A draft step that raises (the draft model's runner failing) leaves every request's
    output as plain decoding gives it, logs why, and drafts no more; the engine serves on."""
    target, small, _ = models
    llm = make_llm(target, block_size=4, speculative_config=_spec(small))
    proposer = llm.engine.scheduler.proposer
    calls = 0

    def fail_on_the_third(queries):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("draft runner failed")
        return type(proposer).propose_batch(proposer, queries)

    monkeypatch.setattr(proposer, "propose_batch", fail_on_the_third)
    with caplog.at_level("ERROR", logger="cenote.scheduler.scheduler"):
        outs = llm.generate(token_prompts(PROMPTS), GREEDY, use_tqdm=False)
    assert_same_completions([o.outputs[0] for o in outs], reference, LOGPROB_ATOL, check_text=False)
    assert calls == 3 and llm.engine.scheduler.proposer is None
    assert "the draft proposer failed; drafting is off" in caplog.text
    (again,) = llm.generate(token_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False)
    assert_same_completions([again.outputs[0]], reference[:1], LOGPROB_ATOL, check_text=False)


def test_drafts_are_the_draft_models_greedy_continuation_after_a_rollback(models) -> None:
    """Each step's drafts equal the small model's own greedy continuation of the context, after
    the target kept some drafts and replaced the next (the draft cache rolls back), for two
    requests at once and for a request that skips a step."""
    target, small, _ = models
    small_plain = make_llm(small, block_size=4)
    llm = make_llm(target, block_size=4, speculative_config=_spec(small, k=4))
    proposer = llm.engine.scheduler.proposer

    def greedy(context: list[int], k: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
        (out,) = small_plain.generate(token_prompts([context]), params, use_tqdm=False)
        return out.outputs[0].token_ids

    a, b = list(PROMPTS[0]), list(PROMPTS[2])
    first = proposer.propose_batch([DraftQuery("a", list(a), 4), DraftQuery("b", list(b), 2)])
    assert first == [greedy(a, 4), greedy(b, 2)]
    # the target keeps one draft of a and replaces the second; b keeps both and adds one
    replacement = (first[0][1] + 1) % 200 + 3
    a += [first[0][0], replacement]
    b += [*first[1], 7]
    second = proposer.propose_batch([DraftQuery("a", list(a), 3), DraftQuery("b", list(b), 4)])
    assert second == [greedy(a, 3), greedy(b, 4)]
    a += [second[0][0], 9]  # b skips this step
    (third,) = proposer.propose_batch([DraftQuery("a", list(a), 4)])
    assert third == greedy(a, 4)
    b += second[1][:2]  # the two drafts the cache holds: the last one is fed again
    (fourth,) = proposer.propose_batch([DraftQuery("b", list(b), 1)])
    assert fourth == greedy(b, 1)
    for request_id in ("a", "b"):
        proposer.release(request_id)
    _assert_draft_cache_empty(llm)


# ---- sampling: the target's distribution ----------------------------------------------------


def test_sampled_tokens_keep_the_targets_distribution(models) -> None:
    """Many requests of one prompt at temperature 0.5 with the small draft (deterministic greedy
    drafts, accepted with probability p(x), else a token of p without x): the prompt's step
    samples the first token plainly, the next step verifies one draft, so each second token is
    distributed as transformers' p(. | prompt, its first token) at that temperature. Every
    token's count of second tokens within 5 standard deviations of the sum of those
    probabilities."""
    target, small, hf_target = models
    num, temperature = 1500, 0.5
    prompt = PROMPTS[1]
    llm = make_llm(target, block_size=4, speculative_config=_spec(small, k=2))
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    outs = llm.generate(token_prompts([prompt] * num), params, use_tqdm=False)
    triples = [o.outputs[0].token_ids for o in outs]
    assert llm.spec_decode_metrics().num_draft_tokens >= num
    firsts = sorted({t[0] for t in triples})
    with torch.no_grad():
        inputs = torch.tensor([[*prompt, first] for first in firsts])
        logits = hf_target(inputs).logits[:, -1].double()  # [num_firsts, vocab]
    probs = dict(zip(firsts, torch.softmax(logits / temperature, -1), strict=True))
    expected = torch.stack([probs[t[0]] for t in triples])  # [num, vocab]: each sample's p
    counts = torch.bincount(torch.tensor([t[1] for t in triples]), minlength=expected.shape[1])
    mean = expected.sum(0)
    bound = 5 * (expected * (1 - expected)).sum(0).sqrt() + 1
    assert ((counts.double() - mean).abs() <= bound).all(), (counts - mean).abs().max()


# ---- configuration --------------------------------------------------------------------------


def _engine_config(target, speculative: dict):
    return EngineArgs(str(target), speculative_config=speculative).create_engine_config()


def test_model_implies_the_method() -> None:
    config = SpeculativeConfig.of({"model": "/some/draft", "num_speculative_tokens": 3})
    assert config is not None and config.method == "draft_model"


@pytest.mark.parametrize(
    ("speculative", "message"),
    [
        ({"method": "draft_model"}, "method draft_model needs a model"),
        ({"method": "ngram", "model": "/x"}, "got method 'ngram', model '/x'"),
        ({"model": "/x", "num_speculative_tokens": 0}, "must be a positive integer, got 0"),
        ({"model": "/x", "num_draft_blocks": 0}, "num_draft_blocks must be a positive integer"),
    ],
)
def test_bad_draft_options_are_refused(speculative: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        SpeculativeConfig.of(speculative)
    assert message in str(error.value)


def test_missing_draft_is_refused_at_start(models, tmp_path) -> None:
    target, _, _ = models
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=r"speculative_config model '.*nowhere' cannot be read"):
        _engine_config(target, _spec(missing))


def test_vocabulary_mismatch_is_refused_with_both_sizes(models, tmp_path) -> None:
    target, _, _ = models
    make_decoder(tmp_path / "wide", "llama", vocab_size=300, **SMALL_DRAFT)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 256"):
        _engine_config(target, _spec(tmp_path / "wide"))


def test_tokenizer_mismatch_is_refused(models, tmp_path) -> None:
    """Same size, two tokens' ids swapped: a draft id would name another token."""
    target, small, _ = models
    other = tmp_path / "swapped"
    shutil.copytree(small, other)
    path = other / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    (x, i), (y, j) = list(vocab.items())[10:12]
    vocab[x], vocab[y] = j, i
    path.write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"tokenizer differs from the target's: 2 of 256 target"):
        _engine_config(target, _spec(other))


def test_an_encoder_is_refused_as_a_draft(models, tmp_path) -> None:
    target, _, _ = models
    make_encoder(tmp_path / "bert", "bert")
    with pytest.raises(ValueError, match="which does not generate; a draft model must be"):
        _engine_config(target, _spec(tmp_path / "bert"))
