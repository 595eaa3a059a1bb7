"""The engine-core process of the server: receive requests, step while there is work, send outputs.

The loop blocks on its input socket when idle (no spinning) and exits when the front process
sends ``Shutdown`` or disappears. It says it is alive with a heartbeat when idle, and a thread
of its own says so while a step runs, however long the step: the front declares the core hung
only when it hears nothing at all (the process stopped or stuck outside Python's reach).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import zmq

from cenote.config import EngineConfig
from cenote.engine.core import EngineCore, refused_output
from cenote.engine.heap import freeze_startup_objects
from cenote.engine.ipc import (
    AbortRequests,
    AddRequests,
    CoreFailed,
    Heartbeat,
    Ready,
    Shutdown,
    StepOutputs,
    input_decoder,
    make_encoder,
)
from cenote.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # how often an idle core checks that its front process is still alive
_STEP_HEARTBEAT_S = 0.5  # how often a core inside a step tells its front it is alive


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """Process entry point (spawned by ``AsyncEngineClient``)."""
    # Ctrl-C or a SIGTERM to the whole process group is the front's to handle: it drains its
    # requests through this core, then sends Shutdown (the core also exits if the front dies).
    if threading.current_thread() is threading.main_thread():  # a Ray actor may run elsewhere
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(message)s")
    # data parallel / several models: each core process on its own share (None: anywhere);
    # before the sockets, so their threads share it
    config.platform.pin_threads(None, config.cpu_ids)
    parent_pid = os.getppid()
    context = zmq.Context(io_threads=1)
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_address)
    encoder = make_encoder()
    try:
        engine = EngineCore(config)
        freeze_startup_objects()  # a process of its own: what is alive now lives as long
        ready = Ready(
            capabilities=engine.capabilities,
            num_threads=torch.get_num_threads(),
            cpu_ids=tuple(sorted(os.sched_getaffinity(0))),
        )
        outputs.send(encoder.encode(ready))
        with StepHeartbeat(context, output_address) as heartbeat:
            _CoreLoop(engine, inputs, outputs, parent_pid, heartbeat).run()
    except Exception as e:
        logger.error("engine core failed:\n%s", traceback.format_exc())
        outputs.send(encoder.encode(CoreFailed(message=f"{type(e).__name__}: {e}")))
        raise SystemExit(1) from e
    finally:
        inputs.close(linger=0)
        outputs.close()
        context.term()


class _CoreLoop:
    def __init__(
        self,
        engine: EngineCore,
        inputs: zmq.Socket[bytes],
        outputs: zmq.Socket[bytes],
        parent_pid: int,
        heartbeat: StepHeartbeat,
    ) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.heartbeat = heartbeat
        self.encoder = make_encoder()
        self.decoder = input_decoder()
        self.running = True

    def run(self) -> None:
        while self.running:
            # 1) wait for input: block when idle, only peek when there is work
            busy = self.engine.has_unfinished_requests()
            if self.inputs.poll(0 if busy else _IDLE_POLL_MS):
                failed = self._drain_inputs()
            elif not busy:
                if os.getppid() != self.parent_pid:
                    return  # the front process is gone
                self.outputs.send(self.encoder.encode(Heartbeat()))
                continue
            else:
                failed = []
            # 2) step while there is work; 3) send its outputs (or just fresh gauges)
            if self.engine.has_unfinished_requests():
                self._step(failed)
            else:
                self._send(EngineCoreOutputs(outputs=failed, stats=self._stats()), [])

    def _drain_inputs(self) -> list[EngineCoreOutput]:
        """Apply every queued message; returns outputs of requests that could not be added."""
        failed: list[EngineCoreOutput] = []
        while True:
            try:
                raw = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return failed
            message = self.decoder.decode(raw)
            if isinstance(message, AddRequests):
                for request in message.requests:
                    try:
                        self.engine.add_request(request)
                    except Exception as e:
                        logger.warning("refused request %s: %s", request.request_id, e)
                        failed.append(refused_output(request.request_id, e))
            elif isinstance(message, AbortRequests):
                self.engine.abort_requests(message.request_ids)
            elif isinstance(message, Shutdown):
                self.running = False

    def _step(self, failed: list[EngineCoreOutput]) -> None:
        waiting = {r.request_id: r.arrival_time for r in self.engine.scheduler.waiting}
        started = time.monotonic()
        with self.heartbeat.during_step():
            step = self.engine.step()
        still_waiting = {r.request_id for r in self.engine.scheduler.waiting}
        queue_times = [started - t for rid, t in waiting.items() if rid not in still_waiting]
        step.outputs.extend(failed)
        self._send(step, queue_times)

    def _send(self, outputs: EngineCoreOutputs, queue_times: list[float]) -> None:
        message = StepOutputs(outputs=outputs, queue_times=queue_times)
        self.outputs.send(self.encoder.encode(message), copy=False)

    def _stats(self) -> SchedulerStats:
        scheduler = self.engine.scheduler
        return SchedulerStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_scheduled_tokens=0,
        )


class StepHeartbeat:
    """A thread that sends ``Heartbeat`` every ``interval`` seconds while a step runs, on its own
    socket (a zmq socket belongs to one thread). Steps are bounded in tokens, not in time: a long
    prompt on a slow machine may take minutes, and the core is not hung meanwhile."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        address: str,
        interval: float = _STEP_HEARTBEAT_S,
    ) -> None:
        self.interval = interval
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._message = make_encoder().encode(Heartbeat())
        self._stepping = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cenote-step-heartbeat", daemon=True)

    def __enter__(self) -> StepHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._closed.set()
        self._stepping.set()  # wake the thread so it sees the close
        self._thread.join()
        self._socket.close()

    @contextmanager
    def during_step(self) -> Iterator[None]:
        self._stepping.set()
        try:
            yield
        finally:
            self._stepping.clear()

    def _run(self) -> None:
        while not self._closed.is_set():
            self._stepping.wait()
            if self._closed.wait(self.interval):
                return
            if self._stepping.is_set():
                try:
                    self._socket.send(self._message, zmq.NOBLOCK)
                except zmq.Again:  # the front is not reading; a missed beat is harmless
                    pass
