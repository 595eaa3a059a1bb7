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
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio
from tokenizers import Tokenizer

from cenote.config import EngineConfig
from cenote.engine.core_launcher import CoreLauncher, Executor, make_launcher
from cenote.engine.input_processor import ModelCapabilities
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
from cenote.engine.output_processor import OutputProcessor, RequestFailure
from cenote.errors import EngineDeadError
from cenote.messages import EngineCoreRequest, SchedulerStats
from cenote.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput

logger = logging.getLogger(__name__)

# a pooling request keeps at most this many steps' token budget in the core at once (measured:
# 1 step gave a small request p50 282 ms behind a maximal one, 2 steps 690 ms; the big request
# itself took no longer)
_WAVE_STEPS = 1

StepCallback = Callable[[SchedulerStats | None, list[float]], None]


class AsyncEngineClient:
    """Owns the engine-core process. Use ``await start()``, then ``pool`` / ``generate``."""

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
        self.queues: dict[str, asyncio.Queue] = {}  # user request id -> its outputs
        self._encoder = make_encoder()
        self._decoder = output_decoder()
        self.executor = executor
        self.ray_address = ray_address
        self._launcher: CoreLauncher | None = None
        self._last_heard = time.monotonic()  # the core's last message (heartbeat or outputs)
        self._closing = False

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> ModelCapabilities:
        """Start the core (a process, or a Ray actor) and wait until its model is loaded."""
        launcher = make_launcher(self.executor, self.ray_address)
        self._launcher = launcher
        (bind_in, connect_in), (bind_out, connect_out) = launcher.addresses()
        self._context = zmq.asyncio.Context(io_threads=1)
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.bind(bind_in)
        self._outputs = self._context.socket(zmq.PULL)
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
        loop = asyncio.get_running_loop()
        launcher.on_exit(loop, self._on_core_exit)
        self._output_task = loop.create_task(self._output_loop())
        return message.capabilities

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
        if getattr(self, "_output_task", None) is not None:
            self._output_task.cancel()
        if getattr(self, "_context", None) is not None:
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

    async def pool(
        self,
        requests: list[EngineCoreRequest],
        prompts: list[str | None],
        output_class: type[PoolingOutput],
    ) -> list[PoolingRequestOutput]:
        """Run pooling requests to completion; results in the order given.

        A big request is sent in waves of about one step's token budget, the next input going
        out as an earlier one finishes: requests that arrive meanwhile queue behind a wave, not
        behind all of it, and small requests keep flowing while a maximal one runs."""
        ids = [r.request_id for r in requests]
        queues = [self._register(request_id) for request_id in ids]
        for request, prompt in zip(requests, prompts, strict=True):
            self.output_processor.add_pooling_request(request, prompt, output_class)
        window = _WAVE_STEPS * self.config.scheduler.max_num_batched_tokens
        unsent = deque(requests)
        in_flight = 0  # tokens sent and not finished

        def send_more() -> None:
            nonlocal in_flight
            wave: list[EngineCoreRequest] = []
            while unsent and (
                in_flight == 0 or in_flight + len(unsent[0].prompt_token_ids) <= window
            ):
                wave.append(unsent.popleft())
                in_flight += len(wave[-1].prompt_token_ids)
            if wave:
                self._send(AddRequests(requests=wave))

        try:
            send_more()
            results = []
            for request, queue in zip(requests, queues, strict=True):
                output = await queue.get()  # sent: every earlier input has finished
                if isinstance(output, Exception):
                    raise output
                results.append(output)
                in_flight -= len(request.prompt_token_ids)
                send_more()
            return results
        finally:
            self._release(ids)

    async def generate(
        self, request_id: str, prompt: str | None, children: list[EngineCoreRequest]
    ) -> AsyncIterator[RequestOutput]:
        """Stream snapshots of one generation request (n children) until it finishes."""
        queue = self._register(request_id)
        self.output_processor.add_generation_request(request_id, prompt, children)
        try:
            self._send(AddRequests(requests=children))
            while True:
                output = await queue.get()
                if isinstance(output, Exception):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            self._release([request_id])

    def _register(self, request_id: str) -> asyncio.Queue:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self.queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        return queue

    def _release(self, request_ids: list[str]) -> None:
        """Forget finished requests; abort in the core those still running (client gone)."""
        to_abort: list[str] = []
        for request_id in request_ids:
            self.queues.pop(request_id, None)
            to_abort.extend(self.output_processor.abort(request_id))
        if to_abort and self.dead_reason is None:
            self._send(AbortRequests(request_ids=to_abort))

    def _send(self, message: CoreInput) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._inputs.send(self._encoder.encode(message), copy=False)

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
            outputs, to_abort = self.output_processor.process_outputs(message.outputs.outputs)
            for output in outputs:
                queue = self.queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output.error if isinstance(output, RequestFailure) else output)
            if to_abort:
                self._send(AbortRequests(request_ids=to_abort))
            if self.on_step is not None:
                self.on_step(message.outputs.stats, message.queue_times)
