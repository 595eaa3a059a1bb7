"""Data-parallel serving: one front, N engine cores, each on its own share of the cores (local
processes on disjoint CPU sets, or Ray actors on a cluster's nodes with zmq over TCP).

``DataParallelEngineClient`` has the surface of ``AsyncEngineClient`` (``add`` / ``outputs`` /
``abort``: the server cannot tell them apart) and owns N of them. Each request goes whole to one core: the least loaded (user requests in
flight), except that a generation request whose first KV block was seen before prefers the core
that served it (its prefix cache holds those blocks) unless that core is clearly busier. A core
that dies fails only its own in-flight requests; the others keep serving and the client reports
itself degraded. Only when every core is gone is the client dead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

from tokenizers import Tokenizer

from cenote.config import EngineConfig
from cenote.engine.async_client import AsyncEngineClient, StepCallback
from cenote.engine.capabilities import ModelCapabilities
from cenote.engine.core_launcher import Executor
from cenote.engine.input_processor import ParentRequest
from cenote.engine.output_processor import UserOutput
from cenote.errors import EngineDeadError
from cenote.messages import SchedulerStats

logger = logging.getLogger(__name__)

_PREFIX_ROUTES = 4096  # first-block keys remembered for prefix-affine routing (LRU)


def split_cores(
    config: EngineConfig, size: int, executor: Executor = "process"
) -> list[EngineConfig]:
    """The config of each of ``size`` engine cores: local processes get disjoint CPU sets of this
    machine, or of ``config.cpu_ids`` when set (threads = their size); Ray actors get
    ``num_threads`` CPUs each (default: this machine's share) wherever Ray places them. Refused on a GPU: the replicas would share it."""
    if config.model.device != "cpu":
        raise ValueError(
            f"data_parallel_size {size} splits this machine's CPU cores between engine cores; "
            f"with device={config.model.device!r} they would share one GPU: use "
            "data_parallel_size 1 (--data-parallel-size), or device='cpu'"
        )
    if executor == "ray":
        threads = config.num_threads or max((os.cpu_count() or 1) // size, 1)
        return [dataclasses.replace(config, num_threads=threads, cpu_ids=None)] * size
    # a model's own CPU set when several models share the machine (engine/cpu_shares.py)
    available = sorted(config.cpu_ids or os.sched_getaffinity(0))
    total = config.num_threads or len(available)
    if size > len(available):
        raise ValueError(
            f"data_parallel_size {size} is more than the {len(available)} CPU cores available"
        )
    share = max(total // size, 1)
    configs = []
    for rank in range(size):
        cpu_ids = tuple(available[rank * share : (rank + 1) * share]) or (available[rank],)
        configs.append(dataclasses.replace(config, num_threads=len(cpu_ids), cpu_ids=cpu_ids))
    return configs


class DataParallelEngineClient:
    """N ``AsyncEngineClient`` cores behind one interface."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        size: int,
        on_step: StepCallback | None = None,
        on_dead: Callable[[str], None] | None = None,
        executor: Executor = "process",
        ray_address: str | None = None,
    ) -> None:
        self.config = config
        self.on_dead = on_dead
        self._on_step = on_step
        self._stats: list[SchedulerStats | None] = [None] * size
        self.cores = [
            AsyncEngineClient(
                core_config,
                tokenizer,
                on_step=self._step_callback(rank),
                on_dead=self._dead_callback(rank),
                executor=executor,
                ray_address=ray_address,
            )
            for rank, core_config in enumerate(split_cores(config, size, executor))
        ]
        self.capabilities: ModelCapabilities | None = None
        self.dead_reason: str | None = None  # set once every core is gone
        self._prefix_routes: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._core_of: dict[str, AsyncEngineClient] = {}  # request id -> the core running it

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> ModelCapabilities:
        """Start every core (one after another: each loads the model with all its threads)."""
        for core in self.cores:
            self.capabilities = await core.start()
        assert self.capabilities is not None
        return self.capabilities

    async def shutdown(self, timeout: float = 10.0) -> None:
        for core in self.cores:
            await core.shutdown(timeout)

    def mark_dead(self, reason: str) -> None:
        for core in self.cores:
            core.mark_dead(reason)

    @property
    def dead_cores(self) -> dict[int, str]:
        """Rank -> why, for every core that is gone."""
        return {i: c.dead_reason for i, c in enumerate(self.cores) if c.dead_reason is not None}

    @property
    def threads_by_core(self) -> list[tuple[int, tuple[int, ...]]]:
        """(torch threads, CPUs) of each started core, in rank order."""
        return [threads for core in self.cores for threads in core.threads_by_core]

    @property
    def num_unfinished(self) -> int:
        return sum(core.num_unfinished for core in self.cores)

    @property
    def silent_for(self) -> float:
        """The longest silence of a live core (a hung core makes the whole server unhealthy)."""
        return max((c.silent_for for c in self._alive()), default=0.0)

    def _dead_callback(self, rank: int) -> Callable[[str], None]:
        def on_core_dead(reason: str) -> None:
            logger.error("engine core %d of %d is gone: %s", rank, len(self.cores), reason)
            if not self._alive():
                self.dead_reason = f"every engine core is gone (core {rank}: {reason})"
                if self.on_dead is not None:
                    self.on_dead(self.dead_reason)

        return on_core_dead

    def _step_callback(self, rank: int) -> StepCallback:
        """Gauges summed over the cores (each core reports only its own queues)."""

        def on_step(stats: SchedulerStats | None, queue_times: list[float]) -> None:
            if stats is not None:
                self._stats[rank] = stats
                known = [s for s in self._stats if s is not None]
                stats = SchedulerStats(
                    num_running=sum(s.num_running for s in known),
                    num_waiting=sum(s.num_waiting for s in known),
                    num_scheduled_tokens=stats.num_scheduled_tokens,
                    kv_cache_usage=sum(s.kv_cache_usage for s in known) / len(known),
                    num_draft_tokens=stats.num_draft_tokens,  # per step: this core's
                    num_accepted_tokens=stats.num_accepted_tokens,
                )
            if self._on_step is not None:
                self._on_step(stats, queue_times)

        return on_step

    # ---- requests ---------------------------------------------------------------------------

    def add(self, requests: Sequence[ParentRequest]) -> None:
        """The pooling requests of one call go to one core; each generation request to its
        own pick (prefix-affine)."""
        added: list[str] = []
        try:
            pooling = [r for r in requests if r.pooling_params is not None]
            if pooling:
                self._add_to(self._pick(None), pooling, added)
            for request in requests:
                if request.pooling_params is None:
                    core = self._pick(self._prefix_key(request.prompt_token_ids))
                    self._add_to(core, [request], added)
        except BaseException:
            self.abort(added)
            raise

    def _add_to(
        self, core: AsyncEngineClient, requests: list[ParentRequest], added: list[str]
    ) -> None:
        core.add(requests)
        for request in requests:
            self._core_of[request.request_id] = core
            added.append(request.request_id)

    async def outputs(self, request_id: str) -> AsyncIterator[UserOutput]:
        core = self._core_of.get(request_id)
        if core is None:
            raise ValueError(f"request {request_id!r} was not added (or is already done)")
        try:
            async for output in core.outputs(request_id):
                yield output
        finally:
            self._core_of.pop(request_id, None)

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            core = self._core_of.pop(request_id, None)
            if core is not None:
                core.abort([request_id])

    def _alive(self) -> list[AsyncEngineClient]:
        return [core for core in self.cores if core.dead_reason is None]

    def _pick(self, prefix_key: tuple[int, ...] | None) -> AsyncEngineClient:
        """The least loaded live core, or the one that holds the prompt's first block when it is
        at most ``max_num_seqs // 4`` requests busier."""
        alive = self._alive()
        if not alive:
            raise EngineDeadError(self.dead_reason or "no engine core is running")
        least = min(alive, key=lambda core: core.num_unfinished)
        if prefix_key is None:
            return least
        rank = self._prefix_routes.get(prefix_key)
        slack = max(self.config.scheduler.max_num_seqs // 4, 1)
        if rank is not None:
            holder = self.cores[rank]
            if holder.dead_reason is None and (
                holder.num_unfinished <= least.num_unfinished + slack
            ):
                self._prefix_routes.move_to_end(prefix_key)
                return holder
        self._prefix_routes[prefix_key] = self.cores.index(least)
        if len(self._prefix_routes) > _PREFIX_ROUTES:
            self._prefix_routes.popitem(last=False)
        return least

    def _prefix_key(self, prompt_token_ids: list[int]) -> tuple[int, ...] | None:
        """The prompt's first full KV block (what the prefix cache can share), if it has one."""
        block_size = self.config.cache.block_size
        if len(prompt_token_ids) < block_size:
            return None
        return tuple(prompt_token_ids[:block_size])
