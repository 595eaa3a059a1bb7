"""Fair shares of the scheduler's queues among calls ("groups": the requests one client ``add``
brought in, ``Request.group_id``).

A call's pooling requests keep at most about one short step's prompt tokens in the queues at
once, its completions at most half of ``max_num_seqs``; the rest of the call is held here, in
arrival order, and joins the waiting queue at the start of a step, once its earlier requests
finished. A request of another call that arrives meanwhile queues behind one share of the big
call, not behind all of it; and where other calls' requests wait at the start of a step, a
call with held requests adds none in that step (at most every other step), so the newcomers'
step is short. Small requests keep flowing while a maximal one runs, offline and served alike,
and the big call still progresses at least every other step. A pooling call alone in the engine
has no share (it queues all of itself, so one offline call runs full steps as before); when
another call arrives, its queued requests that never started past its share go back to held
(``reclaim``), so the newcomer waits for at most the step in flight. A generation call keeps
its half of the sequences even alone: its running sequences cannot be taken back (the
offline client puts no completions in a group: its one caller takes every slot).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from cenote.config import SchedulerConfig
from cenote.request import Request

# a pooling call keeps at most about this much of the engine's time in the queues: the tokens
# the measured step rate runs in it, at most one step's budget (docs/performance.md)
POOLING_SHARE_SECONDS = 0.08
# steps with fewer tokens (decode) say little about the pooling rate; until a step of this many
# is measured, a pooling call's share is this many tokens
RATE_MIN_TOKENS = 256
# a generation call keeps at most this part of max_num_seqs, so that others start beside it
GENERATION_SHARE = 0.5


@dataclass
class _Group:
    """One call's requests of one kind (pooling or generation)."""

    num_in_flight: int = 0  # the cost of its requests in the waiting or running queue
    held: deque[Request] = field(default_factory=deque)  # not queued yet, in arrival order
    yielded: bool = False  # it added nothing at the last step's start, for other calls


class GroupShares:
    """Which requests of each call may be in the scheduler's queues. The cost of a pooling
    request is its prompt tokens, of a generation request one sequence; a call has at least
    one request queued but in a step it yields to other calls (``release``). Requests without
    a group are never held."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.generation_share = max(int(config.max_num_seqs * GENERATION_SHARE), 1)
        self.num_held = 0  # held requests not finished (aborted) since
        self._token_seconds: float | None = None  # one scheduled token's share of a step
        self._groups: dict[tuple[str, bool], _Group] = {}

    @property
    def pooling_share(self) -> int:
        """Prompt tokens a pooling call keeps queued: what the measured rate runs in
        ``POOLING_SHARE_SECONDS``, at most one step's budget; ``RATE_MIN_TOKENS`` until a step
        is measured (a share of one short text would never fill a measurable step)."""
        budget = self.max_num_batched_tokens
        if self._token_seconds is None:
            return min(RATE_MIN_TOKENS, budget)
        return max(min(int(POOLING_SHARE_SECONDS / self._token_seconds), budget), 1)

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """Fold a step's duration into the rate (a moving average over measurable steps)."""
        if seconds <= 0 or num_tokens < RATE_MIN_TOKENS:
            return
        token_seconds = seconds / num_tokens
        old = self._token_seconds
        self._token_seconds = token_seconds if old is None else 0.7 * old + 0.3 * token_seconds

    def take(self, request: Request) -> bool:
        """Count a new request against its call's share; False when it must be held (it joins
        the queue later, from ``release``)."""
        if request.group_id is None:
            return True
        group = self._groups.setdefault((request.group_id, request.is_pooling), _Group())
        if group.num_in_flight and (group.held or not self._fits(group, request)):
            group.held.append(request)
            self.num_held += 1
            return False
        group.num_in_flight += self._cost(request)
        return True

    def leave(self, request: Request) -> None:
        """A queued request left (finished, aborted, failed): its cost is free again."""
        if request.group_id is None:
            return
        group = self._groups[(request.group_id, request.is_pooling)]
        group.num_in_flight -= self._cost(request)
        self._forget_if_done(request.group_id, request.is_pooling)

    def reclaim(self, waiting: Iterable[Request]) -> list[Request]:
        """Where more than one call is in the queues: the queued pooling requests that never
        started of each call past its share (a call that had the engine alone queued all of itself), newest
        first, which go back to the head of their call's held ones; a call keeps at least one
        request queued. The scheduler takes them out of its waiting queue."""
        if len(self._groups) < 2:
            return []
        reclaimed = []
        for request in reversed(list(waiting)):
            key = _key(request)
            if key is None or not request.is_pooling or request.num_computed_tokens:
                continue
            group = self._groups[key]
            cost = self._cost(request)
            share = self._share(request)
            if group.num_in_flight <= share or group.num_in_flight - cost <= 0:
                continue
            group.num_in_flight -= cost
            group.held.appendleft(request)  # newest first: the held keep arrival order
            reclaimed.append(request)
        self.num_held += len(reclaimed)
        return reclaimed

    def release(self, waiting: Iterable[Request]) -> list[Request]:
        """At the start of a step, given the waiting queue: the held requests that join it now,
        in each call's arrival order. A call adds what fits its share (at least one request
        when it has none queued), except that it adds nothing where other calls' requests
        wait, unless it did so at the step before."""
        if not self.num_held:
            return []
        waiting_keys = {_key(request) for request in waiting}
        released = []
        for key, group in list(self._groups.items()):
            group.yielded = bool(group.held) and not group.yielded and bool(waiting_keys - {key})
            while (
                group.held
                and not group.yielded
                and (not group.num_in_flight or self._fits(group, group.held[0]))
            ):
                held = group.held.popleft()
                if held.is_finished:
                    continue  # aborted while held (``drop_held`` counted it)
                group.num_in_flight += self._cost(held)
                released.append(held)
            if not group.num_in_flight and not group.held:
                del self._groups[key]
        self.num_held -= len(released)
        return released

    def drop_held(self, request: Request) -> None:
        """A held request finished before it was queued (aborted); ``release`` skips it."""
        assert request.group_id is not None and request.is_finished
        self.num_held -= 1
        self._forget_if_done(request.group_id, request.is_pooling)

    def _forget_if_done(self, group_id: str, is_pooling: bool) -> None:
        """Drop the finished requests at the head of a call's held ones; forget a call with
        nothing queued and nothing held."""
        key = (group_id, is_pooling)
        group = self._groups[key]
        while group.held and group.held[0].is_finished:
            group.held.popleft()
        if not group.num_in_flight and not group.held:
            del self._groups[key]

    def _fits(self, group: _Group, request: Request) -> bool:
        if request.is_pooling and len(self._groups) == 1:
            return True  # alone in the engine: no one to share with (``reclaim`` when one comes)
        return group.num_in_flight + self._cost(request) <= self._share(request)

    def _share(self, request: Request) -> int:
        """What one call may keep queued of ``request``'s kind (see ``_cost``)."""
        return self.pooling_share if request.is_pooling else self.generation_share

    @staticmethod
    def _cost(request: Request) -> int:
        return request.num_prompt_tokens if request.is_pooling else 1


def _key(request: Request) -> tuple[str, bool] | None:
    """The call a request shares with (None: it shares with nobody)."""
    return None if request.group_id is None else (request.group_id, request.is_pooling)
