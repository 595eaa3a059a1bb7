"""Continuous batching under a token budget. The scheduler speaks only tokens."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

from cenote.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from cenote.kv_cache.block_pool import KVCacheBlock
from cenote.kv_cache.manager import KVCacheManager
from cenote.messages import EngineCoreOutput, LogprobsLists, ModelRunnerOutput
from cenote.request import FINISH_REASONS, Request, RequestStatus
from cenote.scheduler.group_shares import GroupShares
from cenote.scheduler.output import ScheduledRequest, SchedulerOutput
from cenote.spec_decode.ngram import NgramProposer
from cenote.spec_decode.pacing import DraftPacing
from cenote.spec_decode.proposer import DraftQuery, Proposer
from cenote.structured.grammar import RequestGrammar
from cenote.tasks import PoolingTask

logger = logging.getLogger(__name__)


class Scheduler:
    """Waiting and running queues; decides how many new tokens each request computes per step."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager | None,  # None for encoder-only models
        prefix_cacheable_tasks: frozenset[
            PoolingTask
        ] = frozenset(),  # pooling tasks that read only the last token
        max_model_len: int = 1 << 30,  # generation stops here
        speculative: SpeculativeConfig | None = None,  # None: no draft tokens
        proposer: Proposer | None = None,  # the drafts' source; None: n-gram lookup
    ) -> None:
        # encoders have no KV cache and their prompts are computed whole (create_engine_config
        # turns chunked prefill off for them, which is what EngineConfig checks the budget by)
        assert kv_cache_manager is not None or not scheduler_config.enable_chunked_prefill
        self.max_model_len = max_model_len
        self.config = scheduler_config
        self.prefix_cacheable_tasks = prefix_cacheable_tasks
        self.cache_config = cache_config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_request_ids: set[str] = set()
        self.shares = GroupShares(scheduler_config)  # each call's part of the queues
        self.speculative = speculative
        if proposer is None and speculative is not None:
            proposer = NgramProposer(speculative)
        self.proposer = proposer
        self.num_draft_tokens = 0  # drafted since the last take_spec_decode_counts()
        self.num_accepted_tokens = 0  # of those, accepted

    # ---- queue management -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        # Unreachable from LLM or the server, so an invariant and not a refusal: the input
        # processor cuts or refuses every prompt longer than max_model_len, and EngineConfig
        # refuses a budget below max_model_len where prompts are not chunked (encoders).
        fits = self._can_chunk(request) or request.num_tokens <= self.config.max_num_batched_tokens
        assert fits, (
            f"request {request.request_id} has {request.num_tokens} tokens and cannot be split, "
            f"but max_num_batched_tokens is {self.config.max_num_batched_tokens}"
        )
        self.requests[request.request_id] = request
        if self.shares.take(request):
            self._enqueue(request)
        else:
            request.status = RequestStatus.HELD

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            self.waiting.append(request)
            self.waiting = deque(sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time)))
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside (abort, stop string); unknown ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status != RequestStatus.HELD:
                self.waiting.remove(request)
            self._free(request, status)
            finished.append(request)
        return finished

    def _free(self, request: Request, status: RequestStatus) -> None:
        was_held = request.status == RequestStatus.HELD
        request.status = status
        if self.kv_cache_manager is not None:
            self.kv_cache_manager.free(request)
        if self.proposer is not None:
            self.proposer.release(request.request_id)
        self.finished_request_ids.add(request.request_id)
        del self.requests[request.request_id]
        if was_held:
            self.shares.drop_held(request)
        else:
            self.shares.leave(request)

    def record_step_time(self, num_tokens: int, seconds: float) -> None:
        """How long a step of ``num_tokens`` scheduled tokens ran: the rate that sizes a pooling
        call's share of the queues (``GroupShares.pooling_share``)."""
        self.shares.record_step(num_tokens, seconds)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.shares.num_held)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued, or held back by their call's share."""
        return len(self.waiting) + self.shares.num_held

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling -------------------------------------------------------------------------

    def _can_chunk(self, request: Request) -> bool:
        """Causal requests may be split across steps; encoder prompts are computed whole."""
        return self.config.enable_chunked_prefill

    def _can_use_prefix_cache(self, request: Request) -> bool:
        """Skipping cached tokens is safe unless the pooler must see every token's hidden state
        or the request asks for prompt logprobs (they need the logits of every prompt token)."""
        if self.kv_cache_manager is None:
            return False
        if request.sampling_params is not None:
            return request.sampling_params.prompt_logprobs is None
        assert request.pooling_params is not None
        # a multi-task request reads every row if one of its tasks does
        tasks = request.pooling_params.tasks
        return bool(tasks) and all(task in self.prefix_cacheable_tasks for task in tasks)

    def schedule(self) -> SchedulerOutput:
        """Pick the requests of the next step.

        Invariants: at most ``max_num_batched_tokens`` new tokens and ``max_num_seqs`` requests
        per step, of which at most ``max_prompt_logprobs_tokens`` are prompt tokens of requests
        asking for prompt logprobs; running requests go first (oldest first), then waiting ones
        in FCFS (or priority) order, and a waiting request never jumps ahead of an earlier one
        that does not fit. The waiting queue holds only each call's share of its requests
        (``GroupShares``: about one short step of a pooling call's tokens, half of the
        sequences for a generation call; none in a step where other calls' requests wait, at
        most every other step), so a request of another call is scheduled in the next step,
        whatever the size of the calls before it. A request is its ``num_computed_tokens`` catching up with
        ``num_tokens``; encoder requests are scheduled whole. When KV blocks run out, the newest
        (or lowest-priority) running request is preempted and recomputed later. With speculative
        decoding a decoding request may add draft tokens past ``num_tokens``: they take budget
        and KV slots, but only the accepted ones are ever counted as computed.
        """
        # 0) a call past its share since another arrived gives back its unstarted requests; held
        # requests of each call join the queue, behind those that arrived meanwhile
        for reclaimed in self.shares.reclaim(self.waiting):
            self.waiting.remove(reclaimed)
            reclaimed.status = RequestStatus.HELD
        for released in self.shares.release(self.waiting):
            released.status = RequestStatus.WAITING
            self._enqueue(released)
        budget = self.config.max_num_batched_tokens
        logprobs_budget = self.config.max_prompt_logprobs_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        now = time.monotonic()

        # 1) running requests: decode tokens and continuing prompt chunks, drafts proposed
        #    for all decoding ones at once (a draft model runs them as one batch)
        proposed = self._propose_drafts(budget)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_new = self._cap_prompt_logprobs(request, num_new, logprobs_budget)
            if num_new <= 0:
                index += 1
                continue
            drafts = proposed.get(request.request_id, [])[: budget - 1] if num_new == 1 else []
            if drafts and not self._allocate_drafts(request, num_new + len(drafts)):
                drafts = []  # drafts never preempt anybody
            if drafts:
                num_new += len(drafts)
            elif not self._allocate_or_preempt(request, index, num_new, preempted):
                break  # the request itself was preempted
            scheduled.append(self._scheduled(request, num_new, drafts))
            budget -= num_new
            logprobs_budget -= self._num_prompt_logprobs_tokens(request, num_new)
            index += 1

        # 2) waiting requests, unless this step had to preempt
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            num_admitted = self._admit(
                request, self._cap_prompt_logprobs(request, budget, logprobs_budget)
            )
            if num_admitted is None:
                break  # FCFS: nobody jumps the queue
            self.waiting.popleft()
            if request.status == RequestStatus.PREEMPTED:
                request.num_preemptions += 1
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_admitted))
            budget -= num_admitted
            logprobs_budget -= self._num_prompt_logprobs_tokens(request, num_admitted)

        output = SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=preempted,
            finished_request_ids=self.finished_request_ids,
        )
        self.finished_request_ids = set()
        return output

    def _propose_drafts(self, budget: int) -> dict[str, list[int]]:
        """Draft tokens of the running requests that decode, by request id (cut later to the
        budget each finds left). A request is drafted for when speculation is on, it samples
        freely (structured outputs are never drafted for), its pacing allows, and
        ``max_tokens`` and ``max_model_len`` leave room for every draft token plus the token
        verification always adds."""
        if self.proposer is None or self.speculative is None:
            return {}
        queries = []
        for request in self.running:
            limit = self._draft_limit(request, budget)
            if limit > 0:
                queries.append(DraftQuery(request.request_id, request.all_token_ids, limit))
        if not queries:
            return {}
        try:
            drafts = self.proposer.propose_batch(queries)
        except Exception:
            # drafts only ever save time: a failing proposer (a draft model's step raising)
            # must not fail the step or the engine; the requests go on without speculation
            logger.exception(
                "speculative decoding: the draft proposer failed; drafting is off from here on "
                "(every request goes on decoding without drafts)"
            )
            self.proposer = None
            return {}
        return {q.request_id: d for q, d in zip(queries, drafts, strict=True) if d}

    def _draft_limit(self, request: Request, budget: int) -> int:
        """How many tokens to draft for ``request`` this step (0: none)."""
        assert self.speculative is not None
        params = request.sampling_params
        if params is None or request.grammar is not None:
            return 0
        if request.num_tokens - request.num_computed_tokens != 1:
            return 0  # still computing the prompt
        pacing = request.draft_pacing
        if pacing is None:
            pacing = request.draft_pacing = DraftPacing(self.speculative.num_speculative_tokens)
        limit = min(pacing.next_length(), budget - 1, self.max_model_len - request.num_tokens - 1)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
        return limit

    def _allocate_drafts(self, request: Request, num_new: int) -> bool:
        manager = self.kv_cache_manager
        return manager is None or manager.allocate_slots(request, num_new) is not None

    def take_spec_decode_counts(self) -> tuple[int, int]:
        """(drafted, accepted) tokens since the last call; resets both."""
        counts = (self.num_draft_tokens, self.num_accepted_tokens)
        self.num_draft_tokens = self.num_accepted_tokens = 0
        return counts

    @staticmethod
    def _asks_prompt_logprobs(request: Request) -> bool:
        params = request.sampling_params
        return params is not None and params.prompt_logprobs is not None

    def _cap_prompt_logprobs(self, request: Request, num_new: int, logprobs_budget: int) -> int:
        """``num_new`` cut to what is left of the step's prompt-logprobs tokens, for a request
        still computing a prompt whose logprobs it asks for (a chunk then ends at the cut)."""
        if not self._asks_prompt_logprobs(request):
            return num_new
        num_prompt_left = request.num_prompt_tokens - request.num_computed_tokens
        if num_prompt_left <= 0:
            return num_new  # decoding: no prompt logprobs left
        return min(num_new, max(logprobs_budget, 0))

    def _num_prompt_logprobs_tokens(self, request: Request, num_new: int) -> int:
        """Prompt tokens among the ``num_new`` just scheduled (computed ones are counted at the
        step's update) that count against the prompt-logprobs budget."""
        if not self._asks_prompt_logprobs(request):
            return 0
        return max(min(num_new, request.num_prompt_tokens - request.num_computed_tokens), 0)

    def _admit(self, request: Request, budget: int) -> int | None:
        """Allocate for a waiting request; its number of new tokens, or None if it must wait."""
        if budget <= 0:
            return None
        manager = self.kv_cache_manager
        if manager is None:
            num_new = request.num_tokens - request.num_computed_tokens
            return num_new if num_new <= budget else None
        blocks: list[KVCacheBlock] = []
        num_cached = 0
        if self._can_use_prefix_cache(request) and request.num_computed_tokens == 0:
            blocks, num_cached = manager.get_computed_blocks(request)
        num_new = request.num_tokens - request.num_computed_tokens - num_cached
        if num_new > budget:
            if not self._can_chunk(request):
                return None
            num_new = budget
        if manager.allocate_slots(request, num_new, blocks, num_cached) is None:
            return None
        request.num_computed_tokens += num_cached
        request.num_cached_tokens = num_cached
        return num_new

    def _allocate_or_preempt(
        self, request: Request, index: int, num_new: int, preempted: list[str]
    ) -> bool:
        """Allocate for ``running[index]``, preempting requests not yet scheduled this step if
        needed; False if the request itself had to be preempted."""
        while self.kv_cache_manager is not None:
            if self.kv_cache_manager.allocate_slots(request, num_new) is not None:
                return True
            victim = self._pick_victim(self.running[index:])
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        assert self.kv_cache_manager is not None, "only requests holding KV blocks are preempted"
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        if self.proposer is not None:
            self.proposer.release(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._enqueue(request, front=True)

    def _scheduled(
        self, request: Request, num_new: int, drafts: list[int] | None = None
    ) -> ScheduledRequest:
        drafts = drafts or []
        start = request.num_computed_tokens
        end = start + num_new - len(drafts)  # the known tokens computed this step
        prompt_len = request.num_prompt_tokens
        # the new tokens without concatenating prompt and output (O(new), not O(sequence))
        new_ids = request.prompt_token_ids[start:end]
        if end > prompt_len:
            new_ids += request.output_token_ids[max(start - prompt_len, 0) : end - prompt_len]
        new_ids += drafts
        block_ids = (
            self.kv_cache_manager.get_block_ids(request.request_id)
            if self.kv_cache_manager is not None
            else []
        )
        token_type_ids = None
        if request.token_type_ids is not None:
            token_type_ids = request.token_type_ids[start:end]
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=new_ids,
            start_position=start,
            block_ids=block_ids,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            token_type_ids=token_type_ids,
            sampling_params=request.sampling_params,
            pooling_params=request.pooling_params,
            eos_token_id=request.eos_token_id,
            completes_prompt=start < prompt_len <= end,
            needs_sample=request.sampling_params is not None and end == request.num_tokens,
            grammar=request.grammar,
            lora_int_id=None if request.lora_request is None else request.lora_request.lora_int_id,
            pixel_values=request.pixel_values,
            draft_token_ids=drafts,
        )

    # ---- after the step ---------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, finish requests that are done."""
        outputs = []
        for s in scheduler_output.scheduled:
            request = self.requests[s.request_id]
            request.num_computed_tokens += s.num_tokens
            if s.draft_token_ids:  # rejected drafts' KV slots are overwritten later
                request.num_computed_tokens -= self._record_drafts(request, s, runner_output)
            if request.is_pooling:
                if s.completes_prompt:
                    self._finish_running(request, RequestStatus.FINISHED_POOLED)
                    queue_seconds, inference_seconds = _durations(request)
                    pooled = runner_output.pooler_output[request.request_id]
                    outputs.append(
                        EngineCoreOutput(
                            request_id=request.request_id,
                            pooling_output=None if isinstance(pooled, dict) else pooled,
                            pooling_outputs=pooled if isinstance(pooled, dict) else None,
                            finish_reason="stop",
                            num_cached_tokens=request.num_cached_tokens,
                            queue_seconds=queue_seconds,
                            inference_seconds=inference_seconds,
                        )
                    )
                continue
            output = self._update_generation(request, s, runner_output)
            if output is not None:
                outputs.append(output)
        return outputs

    def _update_generation(
        self, request: Request, s: ScheduledRequest, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        request_id = s.request_id
        new_token_ids = runner_output.sampled_token_ids.get(request_id, [])
        prompt_logprobs = self._new_prompt_logprobs(
            request, s.start_position, runner_output.prompt_logprobs.get(request_id)
        )
        if not new_token_ids and prompt_logprobs is None:
            return None
        new_logprobs = runner_output.logprobs.get(request_id)
        status = None
        for num_kept, token_id in enumerate(new_token_ids, start=1):  # stop at the first stop
            request.append_output_token_ids([token_id])
            status = self._check_stop(request)
            if status is not None and num_kept < len(new_token_ids):
                new_token_ids = new_token_ids[:num_kept]
                if new_logprobs is not None:
                    new_logprobs = _first_rows(new_logprobs, num_kept)
                break
        if request.grammar is not None and new_token_ids and status is None:
            status = self._check_grammar(request.grammar, new_token_ids)
        if status is not None:
            self._finish_running(request, status)
        # on every output, not only the last: the front may end a request by a stop string
        queue_seconds, inference_seconds = _durations(request)
        return EngineCoreOutput(
            request_id=request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=FINISH_REASONS[status] if status is not None else None,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            queue_seconds=queue_seconds,
            inference_seconds=inference_seconds,
        )

    def _record_drafts(
        self, request: Request, s: ScheduledRequest, runner_output: ModelRunnerOutput
    ) -> int:
        """Count a verified draft and pace the request's next one; its number of rejected
        tokens (verification emits the accepted drafts plus one token of its own)."""
        num_drafted = len(s.draft_token_ids)
        num_emitted = len(runner_output.sampled_token_ids.get(s.request_id, []))
        num_accepted = min(max(num_emitted - 1, 0), num_drafted)
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if request.draft_pacing is not None:
            request.draft_pacing.record(num_drafted, num_accepted)
        return num_drafted - num_accepted

    @staticmethod
    def _new_prompt_logprobs(
        request: Request, start_position: int, lists: LogprobsLists | None
    ) -> LogprobsLists | None:
        """The rows of ``lists`` (prompt positions from ``start_position``) not returned yet: a
        preempted request recomputes its prompt, and its prompt logprobs are sent only once."""
        if lists is None:
            return None
        skip = request.num_prompt_logprobs_sent - start_position
        request.num_prompt_logprobs_sent = max(
            request.num_prompt_logprobs_sent, start_position + len(lists.ranks)
        )
        if skip <= 0:
            return lists
        if skip >= len(lists.ranks):
            return None
        return LogprobsLists(lists.token_ids[skip:], lists.logprobs[skip:], lists.ranks[skip:])

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        assert params is not None
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if last in (params.stop_token_ids or ()):
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and last == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _check_grammar(grammar: RequestGrammar, token_ids: list[int]) -> RequestStatus | None:
        """Advance the request's matcher; a complete grammar ends the request. The mask allows
        only tokens the grammar accepts, so a refused one means the row had none left."""
        if not grammar.accept(token_ids) or grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED
        return None

    def _finish_running(self, request: Request, status: RequestStatus) -> None:
        self.running.remove(request)
        self._free(request, status)


def _first_rows(lists: LogprobsLists, num_rows: int) -> LogprobsLists:
    return LogprobsLists(
        lists.token_ids[:num_rows], lists.logprobs[:num_rows], lists.ranks[:num_rows]
    )


def _durations(request: Request) -> tuple[float, float]:
    """(queue, inference) seconds of a request with an output now: from the core taking it to
    its first scheduling, and from then to now. Both on this process's monotonic clock (the front's
    ``arrival_time`` is never compared with it). A preempted request's wait to be rescheduled
    counts as inference: it had started."""
    now = time.monotonic()
    first = request.first_scheduled_time if request.first_scheduled_time is not None else now
    return max(first - request.added_time, 0.0), max(now - first, 0.0)
