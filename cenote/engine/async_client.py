"""The front process's handle on an engine-core process: one asyncio queue per request.

The client spawns the core, talks to it over two ipc:// zmq sockets, turns core outputs into user
outputs with the ``OutputProcessor`` and routes them to the waiting request. If the core dies,
every waiting request fails at once with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

import zmq
import zmq.asyncio
from tokenizers import Tokenizer

from cenote.config import EngineConfig
from cenote.engine.capabilities import ModelCapabilities
from cenote.engine.core_launcher import CoreLauncher, Executor, make_launcher
from cenote.engine.input_processor import ParentRequest, assign_group
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
from cenote.messages import SchedulerStats

logger = logging.getLogger(__name__)

StepCallback = Callable[[SchedulerStats | None, list[float]], None]


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
        self._encoder = make_encoder()
        self._decoder = output_decoder()
        self.executor = executor
        self.ray_address = ray_address
        self._launcher: CoreLauncher | None = None
        self._context: zmq.asyncio.Context | None = None  # with the sockets, from start()
        self._output_task: asyncio.Task[None] | None = None  # reads the core's messages
        self._last_heard = time.monotonic()  # the core's last message (heartbeat or outputs)
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
        """Register and send ``requests``, all at once, as one call; read each one's results
        with ``outputs``. The core's scheduler keeps small requests flowing beside a big call
        (``scheduler/group_shares.py``), as it does offline."""
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
            assign_group(requests)
            children = [child for request in requests for child in request.children]
            if children:
                self._send(AddRequests(requests=children))
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
            engine_outputs = message.outputs.outputs
            outputs, to_abort = self.output_processor.process_outputs(engine_outputs)
            for output in outputs:
                queue = self.queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output.error if isinstance(output, RequestFailure) else output)
            if to_abort:
                self._send(AbortRequests(request_ids=to_abort))
            if self.on_step is not None:
                self.on_step(message.outputs.stats, message.queue_times)
