"""The engine-core process of the server: receive requests, step while there is work, send outputs.

The loop blocks on its input socket when idle (no spinning) and exits when the front process
sends ``Shutdown`` or disappears.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback

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


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """Process entry point (spawned by ``AsyncEngineClient``)."""
    # Ctrl-C or a SIGTERM to the whole process group is the front's to handle: it drains its
    # requests through this core, then sends Shutdown (the core also exits if the front dies).
    if threading.current_thread() is threading.main_thread():  # a Ray actor may run elsewhere
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(message)s")
    if config.cpu_ids is not None:  # data parallel: each core process on its own share
        os.sched_setaffinity(0, config.cpu_ids)
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
        outputs.send(encoder.encode(Ready(capabilities=engine.capabilities)))
        _CoreLoop(engine, inputs, outputs, parent_pid).run()
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
    ) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
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
        step = self.engine.step()
        still_waiting = {r.request_id for r in self.engine.scheduler.waiting}
        queue_times = [started - t for rid, t in waiting.items() if rid not in still_waiting]
        step_seconds = time.monotonic() - started
        step.outputs.extend(failed)
        self._send(step, queue_times, step_seconds)

    def _send(
        self, outputs: EngineCoreOutputs, queue_times: list[float], step_seconds: float = 0.0
    ) -> None:
        message = StepOutputs(outputs=outputs, queue_times=queue_times, step_seconds=step_seconds)
        self.outputs.send(self.encoder.encode(message), copy=False)

    def _stats(self) -> SchedulerStats:
        scheduler = self.engine.scheduler
        return SchedulerStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_scheduled_tokens=0,
        )
