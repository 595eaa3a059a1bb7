"""The front process's handle on an engine-core process: one asyncio queue per request.

The client spawns the core, talks to it over two ipc:// zmq sockets, turns core outputs into user
outputs with the ``OutputProcessor`` and routes them to the waiting request. If the core dies,
every waiting request fails at once with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from tokenizers import Tokenizer

from cenote.config import EngineConfig
from cenote.engine.capabilities import ModelCapabilities
from cenote.engine.core_launcher import CoreLauncher, Executor, make_launcher
from cenote.engine.input_processor import ParentRequest
from cenote.engine.ipc import (
    AbortRequests,
    AddRequests,
    CoreFailed,
    CoreInput,
    Ready,
    Shutdown,
    StepOutputs,
    make_encoder,
    output_decoder,
)
from cenote.engine.output_processor import OutputProcessor, RequestFailure, UserOutput
from cenote.errors import EngineDeadError
from cenote.messages import EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)

# a pooling request keeps at most about this much of the core's time in it at once (tokens the
# measured step rate runs in it, at most one step's token budget), so a small request waits
# for about one such step behind a maximal one, whatever the CPU (docs/performance.md)
_POOLING_WAVE_SECONDS = 0.08
_RATE_MIN_TOKENS = 256  # steps with fewer tokens (decode) say little about the pooling rate
# a generation request keeps at most this share of --max-num-seqs running at once, so that
# others start at once beside it
_GENERATION_WAVE_SHARE = 0.5

StepCallback = Callable[[SchedulerStats | None, list[float]], None]


@dataclass
class _Unit:
    """What one wave sends and finishes as one: a pooling request (keyed by its user id,
    costing its prompt tokens) or one completion of a generation request (its engine id,
    costing one sequence)."""

    key: str
    requests: list[EngineCoreRequest]
    cost: int


@dataclass
class _Wave:
    """The requests of one ``add`` call still to send, and the cost in flight."""

    unsent: deque[_Unit]
    window: int | None  # cost in flight at once (after the first unit); None: pooling's
    in_flight: dict[str, int] = field(default_factory=dict)  # unit key -> its cost


class AsyncEngineClient:
    """Owns the engine-core process. ``await start()``, then ``add`` / ``outputs`` / ``abort``
    (``engine.client.AsyncClient``)."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        on_step: StepCallback | None = None,
        on_dead: Callable[[str], None] | None = None,
        executor: Executor = "process",
        ray_address: str | None = None,  # executor "ray": the cluster (None: RAY_ADDRESS or local)
    ) -> None:
        self.config = config
        self.output_processor = OutputProcessor(tokenizer)
        self.on_step = on_step
        self.on_dead = on_dead
        self.capabilities: ModelCapabilities | None = None
        self.dead_reason: str | None = None  # set once the core is gone
        # what the core computes with, as it reports once started: torch threads and CPUs
        self.core_threads: tuple[int, tuple[int, ...]] | None = None
        # user request id -> its outputs, or the exception that ends it
        self.queues: dict[str, asyncio.Queue[UserOutput | Exception]] = {}
        self._waves: dict[str, _Wave] = {}  # pooling request id -> its wave, until it finishes
        self._encoder = make_encoder()
        self._decoder = output_decoder()
        self.executor = executor
        self.ray_address = ray_address
        self._launcher: CoreLauncher | None = None
        self._context: zmq.asyncio.Context | None = None  # with the sockets, from start()
        self._output_task: asyncio.Task[None] | None = None  # reads the core's messages
        self._last_heard = time.monotonic()  # the core's last message (heartbeat or outputs)
        self._token_seconds: float | None = None  # a pooling token's share of a step (average)
        self._closing = False

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> ModelCapabilities:
        """Start the core (a process, or a Ray actor) and wait until its model is loaded."""
        launcher = make_launcher(self.executor, self.ray_address)
        self._launcher = launcher
        (bind_in, connect_in), (bind_out, connect_out) = launcher.addresses()
        self._context = context = zmq.asyncio.Context(io_threads=1)
        self._inputs = context.socket(zmq.PUSH)
        self._inputs.bind(bind_in)
        self._outputs = context.socket(zmq.PULL)
        self._outputs.bind(bind_out)
        launcher.start(self.config, connect_in, connect_out)
        while not await self._outputs.poll(100):
            reason = launcher.exit_reason()
            if reason is not None:
                raise EngineDeadError(reason)
        message = self._decoder.decode(await self._outputs.recv())
        if isinstance(message, CoreFailed):
            raise EngineDeadError(f"the engine core failed to start: {message.message}")
        assert isinstance(message, Ready)
        self.capabilities = message.capabilities
        self.core_threads = (message.num_threads, message.cpu_ids)
        self.output_processor.label_names = message.capabilities.label_names
        loop = asyncio.get_running_loop()
        launcher.on_exit(loop, self._on_core_exit)
        self._output_task = loop.create_task(self._output_loop())
        return message.capabilities

    @property
    def threads_by_core(self) -> list[tuple[int, tuple[int, ...]]]:
        """(torch threads, CPUs) of the core, once started (the data-parallel client: each)."""
        return [self.core_threads] if self.core_threads is not None else []

    @property
    def pid(self) -> int | None:
        """The core's process id (None for a Ray actor or before start)."""
        return self._launcher.pid if self._launcher is not None else None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to exit, wait for it, clean up sockets."""
        self._closing = True
        if self._launcher is not None:
            if self.dead_reason is None and self._launcher.exit_reason() is None:
                self._send(Shutdown())
            await self._launcher.stop(timeout)
        if self._output_task is not None:
            self._output_task.cancel()
        if self._context is not None:
            self._inputs.close(linger=0)
            self._outputs.close(linger=0)
            self._context.term()

    def _on_core_exit(self, reason: str) -> None:
        if not self._closing:
            self.mark_dead(reason)

    def mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s", reason)
        for queue in self.queues.values():
            queue.put_nowait(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)

    # ---- requests ---------------------------------------------------------------------------

    def add(self, requests: Sequence[ParentRequest]) -> None:
        """Register and send ``requests``; read each one's results with ``outputs``.

        The pooling requests of one call go out in waves of about one step's token budget, the
        next as an earlier one finishes; the completions of a generation call (prompts x n) in
        waves of half of ``max_num_seqs``: requests that arrive meanwhile queue behind a wave,
        not behind all of it, and small requests keep flowing while a maximal one runs."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        added: list[str] = []
        try:
            for request in requests:
                if request.request_id in self.queues:
                    raise ValueError(f"request id {request.request_id!r} is already in use")
                self.queues[request.request_id] = asyncio.Queue()
                self.output_processor.add_request(request)
                added.append(request.request_id)
            scheduler = self.config.scheduler
            generation = [
                _Unit(c.request_id, [c], 1)
                for r in requests
                if r.pooling_params is None
                for c in r.children
            ]
            if generation:
                share = max(int(scheduler.max_num_seqs * _GENERATION_WAVE_SHARE), 1)
                self._start_wave(_Wave(deque(generation), share))
            pooling = [
                _Unit(r.request_id, r.children, len(r.prompt_token_ids))
                for r in requests
                if r.pooling_params is not None
            ]
            if pooling:
                self._start_wave(_Wave(deque(pooling), None))
        except BaseException:
            self.abort(added)
            raise

    async def outputs(self, request_id: str) -> AsyncIterator[UserOutput]:
        """The outputs of an added request until it finishes; its failure (or the core's
        death) raises. Leaving early (the client went away) aborts it in the core."""
        queue = self.queues.get(request_id)
        if queue is None:
            raise ValueError(f"request {request_id!r} was not added (or is already done)")
        try:
            while True:
                output = await queue.get()
                if isinstance(output, Exception):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            self.abort([request_id])

    def abort(self, request_ids: Iterable[str]) -> None:
        """Forget requests; abort in the core those still running (client gone)."""
        to_abort: list[str] = []
        for request_id in request_ids:
            self.queues.pop(request_id, None)
            to_abort.extend(self.output_processor.abort(request_id))
        if to_abort and self.dead_reason is None:
            self._send(AbortRequests(request_ids=to_abort))
        self._finish_units([*request_ids, *to_abort])

    def _start_wave(self, wave: _Wave) -> None:
        self._waves.update((unit.key, wave) for unit in wave.unsent)
        self._send_wave(wave)

    def _send_wave(self, wave: _Wave) -> None:
        """Send the wave's next units while they fit its window (at least one)."""
        batch = []
        window = wave.window if wave.window is not None else self.pooling_window
        while wave.unsent and (
            not wave.in_flight or sum(wave.in_flight.values()) + wave.unsent[0].cost <= window
        ):
            unit = wave.unsent.popleft()
            if unit.requests[0].request_id not in self.output_processor.parent_of:
                self._waves.pop(unit.key, None)
                continue  # aborted before it went out
            wave.in_flight[unit.key] = unit.cost
            batch.extend(unit.requests)
        if batch and self.dead_reason is None:
            self._send(AddRequests(requests=batch))

    def _finish_units(self, keys: Iterable[str]) -> None:
        """Take finished (or aborted) units out of their waves, and send what now fits."""
        waves: dict[int, _Wave] = {}
        for key in keys:
            wave = self._waves.pop(key, None)
            if wave is not None:
                wave.in_flight.pop(key, None)
                waves[id(wave)] = wave
        for wave in waves.values():
            self._send_wave(wave)

    def _send(self, message: CoreInput) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._inputs.send(self._encoder.encode(message), copy=False)

    @property
    def pooling_window(self) -> int:
        """Prompt tokens a pooling wave keeps in the core: what the measured rate runs in
        ``_POOLING_WAVE_SECONDS``, at most one step's budget. Until a step is measured: the
        fewest tokens a step must hold to be measured (a window of 1, one request at a time,
        never measured a step of short texts: the server then embedded them one per step)."""
        budget = self.config.scheduler.max_num_batched_tokens
        if self._token_seconds is None:
            return min(_RATE_MIN_TOKENS, budget)
        return max(min(int(_POOLING_WAVE_SECONDS / self._token_seconds), budget), 1)

    def _measure(self, message: StepOutputs) -> None:
        num_tokens = message.outputs.stats.num_scheduled_tokens if message.outputs.stats else 0
        if message.step_seconds <= 0 or num_tokens < _RATE_MIN_TOKENS:
            return
        seconds = message.step_seconds / num_tokens
        old = self._token_seconds
        self._token_seconds = seconds if old is None else 0.7 * old + 0.3 * seconds

    @property
    def dead_cores(self) -> dict[int, str]:
        """Rank -> why, for every engine core that is gone (here: the one, or none)."""
        return {0: self.dead_reason} if self.dead_reason is not None else {}

    @property
    def num_unfinished(self) -> int:
        """User requests in flight (the load a balancer compares)."""
        return self.output_processor.num_unfinished

    @property
    def silent_for(self) -> float:
        """Seconds since the core last sent anything (outputs or an idle heartbeat)."""
        return time.monotonic() - self._last_heard

    async def _output_loop(self) -> None:
        while True:
            message = self._decoder.decode(await self._outputs.recv())
            self._last_heard = time.monotonic()
            if isinstance(message, CoreFailed):
                self.mark_dead(f"the engine core failed: {message.message}")
                return
            if not isinstance(message, StepOutputs):
                continue
            self._measure(message)
            engine_outputs = message.outputs.outputs
            outputs, to_abort = self.output_processor.process_outputs(engine_outputs)
            for output in outputs:
                queue = self.queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output.error if isinstance(output, RequestFailure) else output)
            if to_abort:
                self._send(AbortRequests(request_ids=to_abort))
            finished = [o.request_id for o in outputs if o.finished]  # pooling units
            finished += [o.request_id for o in engine_outputs if o.finish_reason or o.error]
            self._finish_units([*finished, *to_abort])
            if self.on_step is not None:
                self.on_step(message.outputs.stats, message.queue_times)
