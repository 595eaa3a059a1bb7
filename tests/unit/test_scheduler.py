"""Scheduler unit tests: no weights, fake model outputs.

A step is simulated as ``out = schedule()`` then ``update_from_output(out, fake_runner(out))``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from cenote.config import CacheConfig, SchedulerConfig
from cenote.kv_cache.manager import KVCacheManager
from cenote.messages import ModelRunnerOutput
from cenote.pooling_params import PoolingParams
from cenote.request import Request, RequestStatus
from cenote.sampling_params import SamplingParams
from cenote.scheduler.output import SchedulerOutput
from cenote.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4


def _encoder_scheduler(budget: int, max_seqs: int = 256) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=False
    )
    return Scheduler(config, CacheConfig(), kv_cache_manager=None)


def _causal_scheduler(
    budget: int, num_blocks: int, max_seqs: int = 256, prefix_caching: bool = True
) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=prefix_caching)
    return Scheduler(config, cache, kv_cache_manager=manager)


def _pooling(request_id: str, num_tokens: int, seed: int = 0) -> Request:
    rng = random.Random(f"{request_id}-{seed}")
    return Request(
        request_id=request_id,
        prompt_token_ids=[rng.randrange(5, 1000) for _ in range(num_tokens)],
        sampling_params=None,
        pooling_params=PoolingParams(task="embed"),
    )


def _generation(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        eos_token_id=None,
    )


def _fake_token(request_id: str, index: int) -> int:
    """The token a deterministic fake model samples as output ``index`` of a request."""
    return 1000 + (sum(map(ord, request_id)) * 31 + index * 7) % 997


def _fake_runner(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Pools every prompt that completes; samples where the known tokens end."""
    result = ModelRunnerOutput()
    for s in out.scheduled:
        if s.pooling_params is not None and s.completes_prompt:
            result.pooler_output[s.request_id] = torch.zeros(1)
        if s.needs_sample:
            index = len(scheduler.requests[s.request_id].output_token_ids)
            result.sampled_token_ids[s.request_id] = [_fake_token(s.request_id, index)]
    return result


def _check_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    config = scheduler.config
    assert out.total_num_scheduled_tokens == sum(s.num_tokens for s in out.scheduled)
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(out.scheduled) <= config.max_num_seqs
    assert len(scheduler.running) <= config.max_num_seqs
    ids = [s.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request was scheduled twice in one step"
    for s in out.scheduled:
        assert s.num_tokens > 0
        request = scheduler.requests[s.request_id]
        assert s.start_position == request.num_computed_tokens
        assert s.start_position + s.num_tokens <= request.num_tokens
        assert (
            s.token_ids == request.all_token_ids[s.start_position : s.start_position + s.num_tokens]
        )
        if scheduler.kv_cache_manager is None:  # encoders: whole prompts only
            assert s.start_position == 0 and s.num_tokens == request.num_prompt_tokens
        else:
            capacity = len(s.block_ids) * BLOCK_SIZE
            assert s.start_position + s.num_tokens <= capacity
    manager = scheduler.kv_cache_manager
    if manager is not None:
        # prefix-cache hits share blocks between requests: count distinct blocks
        held = {b for r in scheduler.requests for b in manager.get_block_ids(r)}
        assert len(held) + manager.num_free_blocks <= manager.num_blocks


def _run(
    scheduler: Scheduler,
    arrivals: dict[int, list[Request]] | None = None,
    max_steps: int = 10_000,
    on_step: Callable[[int, SchedulerOutput, list], None] | None = None,
) -> dict[str, int]:
    """Step until idle (adding ``arrivals[step]`` before each step); request id -> finish step."""
    arrivals = dict(arrivals or {})
    finished: dict[str, int] = {}
    for step in range(max_steps):
        for request in arrivals.pop(step, []):
            scheduler.add_request(request)
        if not arrivals and not scheduler.has_unfinished_requests():
            return finished
        out = scheduler.schedule()
        _check_step(scheduler, out)
        outputs = scheduler.update_from_output(out, _fake_runner(scheduler, out))
        for output in outputs:
            if output.finish_reason is not None:
                assert output.request_id not in finished
                finished[output.request_id] = step
        if on_step is not None:
            on_step(step, out, outputs)
    raise AssertionError(f"scheduler did not finish in {max_steps} steps")


# ---- encoder (pooling, whole prompts) -------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_encoder_random_requests_respect_limits_and_order(seed: int) -> None:
    rng = random.Random(seed)
    budget, max_seqs = 64, 5
    scheduler = _encoder_scheduler(budget, max_seqs)
    arrivals: dict[int, list[Request]] = {}
    order = []
    for i in range(200):
        request = _pooling(f"r{i}", rng.randint(1, budget), seed)
        arrivals.setdefault(rng.randrange(60), []).append(request)
    for step in sorted(arrivals):
        order.extend(r.request_id for r in arrivals[step])
    first_step: dict[str, int] = {}

    def on_step(step: int, out: SchedulerOutput, outputs: list) -> None:
        scheduled = [s.request_id for s in out.scheduled]
        for s in out.scheduled:
            assert s.completes_prompt
            first_step.setdefault(s.request_id, step)
        # pooling requests finish in the step their prompt completes, with their pooled output
        assert sorted(o.request_id for o in outputs) == sorted(scheduled)
        assert all(o.finish_reason == "stop" and o.pooling_output is not None for o in outputs)
        assert not scheduler.running

    finished = _run(scheduler, arrivals, on_step=on_step)
    assert sorted(finished) == sorted(order)
    assert finished == first_step
    # FCFS: the order of first scheduling is the order of arrival
    assert sorted(order, key=lambda r: (first_step[r], order.index(r))) == order
    assert not scheduler.requests


def test_fcfs_no_queue_jumping() -> None:
    scheduler = _encoder_scheduler(budget=10)
    for request in (_pooling("a", 8), _pooling("b", 5), _pooling("c", 2)):
        scheduler.add_request(request)
    first = scheduler.schedule()
    # "c" would fit next to "a", but must not overtake "b"
    assert [s.request_id for s in first.scheduled] == ["a"]
    scheduler.update_from_output(first, _fake_runner(scheduler, first))
    second = scheduler.schedule()
    assert [s.request_id for s in second.scheduled] == ["b", "c"]
    outputs = scheduler.update_from_output(second, _fake_runner(scheduler, second))
    assert [o.request_id for o in outputs] == ["b", "c"]
    assert not scheduler.has_unfinished_requests()


def test_max_num_seqs_limits_a_step() -> None:
    scheduler = _encoder_scheduler(budget=1000, max_seqs=3)
    for i in range(7):
        scheduler.add_request(_pooling(f"r{i}", 2))
    sizes = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sizes.append([s.request_id for s in out.scheduled])
        scheduler.update_from_output(out, _fake_runner(scheduler, out))
    assert sizes == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]


def test_encoder_prompt_of_the_whole_budget_runs_in_one_step() -> None:
    """A longer one never reaches the scheduler: the input processor holds prompts to
    max_model_len, EngineConfig the budget of unchunked prompts to at least that
    (test_bad_input, test_engine_args)."""
    scheduler = _encoder_scheduler(budget=16)
    scheduler.add_request(_pooling("fits", 16))
    assert _run(scheduler) == {"fits": 0}


# ---- causal (chunked prefill, paged KV cache, preemption) -----------------------------------


def test_causal_pooling_prompt_is_chunked_and_finishes_with_its_last_chunk() -> None:
    scheduler = _causal_scheduler(budget=16, num_blocks=64)
    scheduler.add_request(_pooling("long", 40))
    chunks = []

    def on_step(step: int, out: SchedulerOutput, outputs: list) -> None:
        (s,) = out.scheduled
        chunks.append((s.start_position, s.num_tokens, s.completes_prompt, len(outputs)))

    assert _run(scheduler, on_step=on_step) == {"long": 2}
    assert chunks == [(0, 16, False, 0), (16, 16, False, 0), (32, 8, True, 1)]
    assert scheduler.kv_cache_manager.num_free_blocks == 64  # pooling frees its blocks at once


def test_generation_decodes_max_tokens_then_stops() -> None:
    scheduler = _causal_scheduler(budget=32, num_blocks=32)
    scheduler.add_request(_generation("g", list(range(10, 20)), max_tokens=5))
    steps = []

    def on_step(step: int, out: SchedulerOutput, outputs: list) -> None:
        steps.append([(s.num_tokens, s.needs_sample) for s in out.scheduled])

    finished = _run(scheduler, on_step=on_step)
    assert finished == {"g": 4}
    assert steps == [[(10, True)]] + [[(1, True)]] * 4  # prefill, then one token per step


def test_prompt_logprobs_prompts_share_a_bounded_number_of_tokens_per_step() -> None:
    """Each prompt token whose logprobs are asked is a full-vocabulary row of logits: those
    tokens have their own budget per step, all requests together; other requests and decoding
    are not bound by it."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_prompt_logprobs_tokens=8)
    cache = CacheConfig(block_size=BLOCK_SIZE)
    scheduler = Scheduler(config, cache, KVCacheManager(64, BLOCK_SIZE, enable_caching=True))
    for name in ("a", "b"):
        request = _generation(name, list(range(10, 30)), max_tokens=2)  # 20 prompt tokens
        assert request.sampling_params is not None
        request.sampling_params.prompt_logprobs = 1
        scheduler.add_request(request)
    scheduler.add_request(_generation("plain", list(range(40, 60)), max_tokens=2))
    steps = []

    def on_step(step: int, out: SchedulerOutput, outputs: list) -> None:
        steps.append([(s.request_id, s.start_position, s.num_tokens) for s in out.scheduled])

    _run(scheduler, on_step=on_step)
    # "b" waits (FCFS, and "plain" behind it) until "a"'s last prompt chunk leaves it room
    assert steps == [
        [("a", 0, 8)],
        [("a", 8, 8)],
        [("a", 16, 4), ("b", 0, 4), ("plain", 0, 20)],
        [("a", 20, 1), ("b", 4, 8), ("plain", 20, 1)],
        [("b", 12, 8)],
        [("b", 20, 1)],
    ]


@pytest.mark.parametrize("seed", range(3))
def test_causal_random_mix_with_small_kv_cache_preempts_and_completes(seed: int) -> None:
    """Generation and pooling requests share a budget of 24 tokens and 16 blocks of 4 tokens;
    requests fit alone but not together, so running requests get preempted and recomputed."""
    rng = random.Random(seed)
    num_blocks, budget, max_seqs = 16, 24, 6
    scheduler = _causal_scheduler(budget, num_blocks, max_seqs)
    arrivals: dict[int, list[Request]] = {}
    generation: dict[str, Request] = {}
    order = []
    shared_prefix = [rng.randrange(5, 1000) for _ in range(8)]  # exercises prefix-cache hits
    for i in range(40):
        if rng.random() < 0.3:
            request = _pooling(f"p{i}", rng.randint(1, 50), seed)
        else:
            max_tokens = rng.randint(1, 12)
            prompt_len = rng.randint(1, num_blocks * BLOCK_SIZE - max_tokens)
            prompt = [rng.randrange(5, 1000) for _ in range(prompt_len)]
            if rng.random() < 0.5 and prompt_len > 8:
                prompt[:8] = shared_prefix
            request = _generation(f"g{i}", prompt, max_tokens)
            generation[request.request_id] = request
        arrivals.setdefault(rng.randrange(30), []).append(request)
        order.append(request.request_id)
    num_preempted = 0

    def on_step(step: int, out: SchedulerOutput, outputs: list) -> None:
        nonlocal num_preempted
        num_preempted += len(out.preempted_request_ids)
        scheduled = {s.request_id for s in out.scheduled}
        assert not scheduled & set(out.preempted_request_ids)
        for s in out.scheduled:
            if s.pooling_params is not None and s.completes_prompt:
                assert any(o.request_id == s.request_id for o in outputs)

    finished = _run(scheduler, arrivals, on_step=on_step)
    assert sorted(finished) == sorted(order)
    assert num_preempted > 0, "the KV cache must be small enough to force preemption"
    for request_id, request in generation.items():
        # preemption and recomputation neither lose nor repeat sampled tokens
        expected = [_fake_token(request_id, i) for i in range(request.sampling_params.max_tokens)]
        assert request.output_token_ids == expected, request_id
        assert request.status == RequestStatus.FINISHED_LENGTH
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == num_blocks and not manager.req_to_blocks
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting


def test_preemption_takes_the_newest_request_and_requeues_it_first() -> None:
    # 4 blocks of 4 tokens; two 7-token prompts take 2 blocks each, then both need a third
    scheduler = _causal_scheduler(budget=64, num_blocks=4, prefix_caching=False)
    old = _generation("old", list(range(10, 17)), max_tokens=4)
    new = _generation("new", list(range(20, 27)), max_tokens=4)
    scheduler.add_request(old)
    scheduler.add_request(new)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["old", "new"]
    scheduler.update_from_output(out, _fake_runner(scheduler, out))  # 8 tokens each now
    out = scheduler.schedule()  # both decode into full blocks: fits
    scheduler.update_from_output(out, _fake_runner(scheduler, out))  # 9 tokens each
    out = scheduler.schedule()  # "old" needs a 3rd block: "new" is evicted
    assert [s.request_id for s in out.scheduled] == ["old"]
    assert out.preempted_request_ids == ["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert scheduler.waiting[0] is new
    scheduler.update_from_output(out, _fake_runner(scheduler, out))
    finished = _run(scheduler)
    assert set(finished) == {"old", "new"}
    assert new.num_preemptions == 1
    assert new.output_token_ids == [_fake_token("new", i) for i in range(4)]


def test_priority_policy_runs_interactive_requests_before_queued_batch_lines() -> None:
    """``cenote serve --batch-dir`` schedules by priority: batch lines (BATCH_PRIORITY) queued
    first still wait for an interactive request (priority 0) that arrives after them."""
    from cenote.server.batch_jobs import BATCH_PRIORITY

    config = SchedulerConfig(
        max_num_batched_tokens=10, max_num_seqs=256, enable_chunked_prefill=False,
        policy="priority",
    )  # fmt: skip
    scheduler = Scheduler(config, CacheConfig(), kv_cache_manager=None)
    for i in range(3):
        line = _pooling(f"batch-{i}", 6)
        line.priority = BATCH_PRIORITY
        scheduler.add_request(line)
    scheduler.add_request(_pooling("chat", 6))
    order = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        order.append([s.request_id for s in out.scheduled])
        scheduler.update_from_output(out, _fake_runner(scheduler, out))
    assert order == [["chat"], ["batch-0"], ["batch-1"], ["batch-2"]]


# ---- fair shares among calls (scheduler/group_shares.py) ------------------------------------


def _in_group(request: Request, group_id: str) -> Request:
    request.group_id = group_id
    return request


def test_a_small_call_runs_in_the_first_step_beside_a_big_pooling_call() -> None:
    """A call of 1,000 texts does not take the step's budget from a one-text call that came
    after it: with another call in the engine the big call keeps one share of tokens queued
    (the rest goes back to held, in order), the small one is scheduled in the first step and
    every text of the big call finishes in order. One that comes while the big call runs gets
    a step of its own: the big call yields it. Alone, the big call runs full steps (an offline
    call schedules as it did before shares)."""
    scheduler = _encoder_scheduler(budget=8192)
    share = scheduler.shares.pooling_share
    big = [_in_group(_pooling(f"big-{i}", 16), "big") for i in range(1000)]
    for request in big:
        scheduler.add_request(request)
    scheduler.add_request(_in_group(_pooling("small", 8), "small"))
    assert scheduler.num_waiting == 1001
    first_step: dict[str, int] = {}
    later = _in_group(_pooling("later", 8), "later")

    big_tokens_per_step: list[int] = []

    def on_step(step: int, out: SchedulerOutput, outputs: list) -> None:
        big_tokens = sum(s.num_tokens for s in out.scheduled if s.request_id.startswith("big"))
        big_tokens_per_step.append(big_tokens)
        if step == 0:
            assert big_tokens <= share  # beside the small call
        if step == 5:
            assert big_tokens == 0  # the newcomer's step
        for s in out.scheduled:
            first_step[s.request_id] = step

    finished = _run(scheduler, {5: [later]}, on_step=on_step)
    assert big_tokens_per_step[1] == 256 * 16  # alone again: a full step (max_num_seqs rows)
    assert finished["small"] == 0 and finished["later"] == 5
    assert len(finished) == 1002 and not scheduler.requests and scheduler.num_waiting == 0
    big_order = sorted(range(1000), key=lambda i: first_step[f"big-{i}"])
    assert big_order == list(range(1000))


def test_the_measured_step_rate_sizes_a_pooling_share() -> None:
    scheduler = _encoder_scheduler(budget=8192)
    assert scheduler.shares.pooling_share == 256  # before any step is measured
    scheduler.record_step_time(100, 1.0)  # too few tokens to say anything
    assert scheduler.shares.pooling_share == 256
    scheduler.record_step_time(1000, 0.1)  # 1e-4 s a token: 0.08 s runs 800 tokens
    assert scheduler.shares.pooling_share == 800
    scheduler.record_step_time(1000, 0.2)  # a moving average: 0.7 x 1e-4 + 0.3 x 2e-4
    assert scheduler.shares.pooling_share == 615
    fast = _encoder_scheduler(budget=8192)
    fast.record_step_time(1000, 0.001)  # 0.08 s runs 80,000 tokens: one step's budget
    assert fast.shares.pooling_share == 8192


def test_a_generation_call_keeps_half_of_the_sequences() -> None:
    """A call of 8 completions on 4 sequence slots runs 2 at once: a later call's request
    starts in the next step instead of waiting for the big call to finish."""
    scheduler = _causal_scheduler(budget=64, num_blocks=64, max_seqs=4)
    for i in range(8):
        scheduler.add_request(_in_group(_generation(f"big-{i}", [5, 6], max_tokens=50), "big"))
    first = scheduler.schedule()
    assert [s.request_id for s in first.scheduled] == ["big-0", "big-1"]
    scheduler.update_from_output(first, _fake_runner(scheduler, first))
    scheduler.add_request(_in_group(_generation("small", [7], max_tokens=2), "small"))
    finished = _run(scheduler)
    assert finished["small"] <= 2 < finished["big-7"]


def test_decode_rows_run_every_step_beside_a_big_pooling_call() -> None:
    scheduler = _causal_scheduler(budget=300, num_blocks=512)
    scheduler.add_request(_in_group(_generation("chat", [5, 6, 7], max_tokens=20), "chat"))
    for i in range(200):
        scheduler.add_request(_in_group(_pooling(f"big-{i}", 40), "big"))
    decoded_steps = []

    def on_step(step: int, out: SchedulerOutput, outputs: list) -> None:
        if "chat" in scheduler.requests or any(o.request_id == "chat" for o in outputs):
            decoded_steps.append(any(s.request_id == "chat" for s in out.scheduled))

    finished = _run(scheduler, on_step=on_step)
    assert all(decoded_steps) and len(decoded_steps) == 20
    assert finished["chat"] < finished["big-199"]


def test_a_pooling_call_alone_queues_all_of_itself_and_shares_when_another_comes() -> None:
    """Alone, a call's texts all queue (full steps, as offline before shares); when a second
    call arrives, the first call's unstarted texts past its share go back to held, in order."""
    scheduler = _encoder_scheduler(budget=8192)
    share = scheduler.shares.pooling_share
    for i in range(100):
        scheduler.add_request(_in_group(_pooling(f"big-{i}", 16), "big"))
    assert len(scheduler.waiting) == 100 and scheduler.shares.num_held == 0
    scheduler.add_request(_in_group(_pooling("small", 8), "small"))
    out = scheduler.schedule()
    ids = [s.request_id for s in out.scheduled]
    assert (
        "small" in ids
        and sum(s.num_tokens for s in out.scheduled if s.request_id != "small") <= share
    )
    held = [r.request_id for r in scheduler.requests.values() if r.status == RequestStatus.HELD]
    assert held == [f"big-{i}" for i in range(100 - len(held), 100)] and held  # the newest
    assert [r.request_id for r in scheduler.shares._groups["big", True].held] == held  # in order


def test_held_requests_can_be_aborted() -> None:
    """Aborting a big call's held requests (the client went away) forgets them: the queue
    never schedules them and the engine goes idle."""
    scheduler = _encoder_scheduler(budget=1000)
    scheduler.add_request(_in_group(_pooling("other", 8), "other"))  # so the big call shares
    for i in range(100):
        scheduler.add_request(_in_group(_pooling(f"big-{i}", 100), "big"))
    assert scheduler.requests["big-50"].status == RequestStatus.HELD
    scheduler.finish_requests([f"big-{i}" for i in range(1, 100)], RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_waiting == 2
    assert sorted(_run(scheduler)) == ["big-0", "other"]
    assert not scheduler.has_unfinished_requests() and scheduler.shares.num_held == 0
