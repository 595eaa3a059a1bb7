"""Where an engine core runs: a local process (ipc:// sockets) or a Ray actor (tcp:// sockets).

The front binds both zmq sockets and hands their addresses to the core; a launcher starts the
core and tells when it has ended. ``AsyncEngineClient`` uses either without knowing which.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

from cenote.config import EngineConfig
from cenote.engine.core_proc import run_engine_core

Executor = Literal["process", "ray"]

# The core shares its cores with the front process (HTTP, JSON, tokenization): its OpenMP threads
# spin only briefly before sleeping when they wait, so a thread of the front does not leave a
# core thread spinning; fully passive waiting is slower (docs/performance.md, "numbers out of code
# comments"). A value the user set in the environment wins.
CORE_ENVIRONMENT = {"GOMP_SPINCOUNT": "2000"}
_environment_lock = threading.Lock()


class CoreLauncher(Protocol):
    def addresses(self) -> tuple[tuple[str, str], tuple[str, str]]:
        """(bind, connect) address of the front->core socket, then of the core->front one."""
        ...

    def start(self, config: EngineConfig, input_address: str, output_address: str) -> None: ...

    def exit_reason(self) -> str | None:
        """Why the core ended, or None while it runs (never blocks)."""
        ...

    def on_exit(self, loop: asyncio.AbstractEventLoop, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` on ``loop`` when the core ends."""
        ...

    async def stop(self, timeout: float) -> None:
        """Wait for the core to end (after Shutdown), killing it past ``timeout``."""
        ...

    @property
    def pid(self) -> int | None: ...


class ProcessLauncher:
    """The core as a spawned child process; ipc:// sockets in a private temporary folder."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="cenote-ipc-"))
        self._process: multiprocessing.process.BaseProcess | None = None
        self._watching: tuple[asyncio.AbstractEventLoop, int] | None = None

    def addresses(self) -> tuple[tuple[str, str], tuple[str, str]]:
        inputs, outputs = f"ipc://{self._dir / 'in'}", f"ipc://{self._dir / 'out'}"
        return (inputs, inputs), (outputs, outputs)

    def start(self, config: EngineConfig, input_address: str, output_address: str) -> None:
        threads = config.num_threads or len(config.cpu_ids or os.sched_getaffinity(0))
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(dataclasses.replace(config, num_threads=threads), input_address, output_address),
            name="cenote-engine-core",
            daemon=True,
        )
        with child_environment(CORE_ENVIRONMENT):  # OpenMP reads it when torch loads
            process.start()
        self._process = process

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def exit_reason(self) -> str | None:
        process = self._process
        if process is None or process.is_alive():
            return None
        return f"the engine core process exited unexpectedly (exit code {process.exitcode})"

    def on_exit(self, loop: asyncio.AbstractEventLoop, callback: Callable[[str], None]) -> None:
        process = self._process
        assert process is not None

        def exited() -> None:
            loop.remove_reader(process.sentinel)
            self._watching = None
            process.join(0)
            callback(self.exit_reason() or "the engine core process exited")

        loop.add_reader(process.sentinel, exited)
        self._watching = (loop, process.sentinel)

    async def stop(self, timeout: float) -> None:
        process = self._process
        if self._watching is not None:
            loop, sentinel = self._watching
            loop.remove_reader(sentinel)
            self._watching = None
        if process is not None and process.is_alive():
            await asyncio.to_thread(process.join, timeout)
            if process.is_alive():
                process.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


class RayLauncher:
    """The core as a Ray actor with ``num_threads`` CPUs, on any node of the cluster; tcp://
    sockets on this node's address. The model path must exist on the node the actor lands on."""

    def __init__(self, address: str | None) -> None:
        import ray

        if not ray.is_initialized():
            # ray.init installs its own SIGTERM handler: keep the server's (graceful drain)
            handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                ray.init(address=address, log_to_driver=False)
            except ConnectionError as e:
                raise ValueError(f"no Ray cluster answers at {address!r}: {e}") from e
            finally:
                if threading.current_thread() is threading.main_thread():
                    for sig, handler in handlers.items():
                        signal.signal(sig, handler)
        self._ray = ray
        self._host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._ports = [_free_port(), _free_port()]
        self._actor: Any = None  # the core's actor handle
        self._done: Any = None  # the ObjectRef of the core's loop
        # set by stop() under the lock: the watcher thread then no longer calls back into a
        # loop that may be closed by the time the actor's end reaches it
        self._watch_lock = threading.Lock()
        self._stopping = False

    def addresses(self) -> tuple[tuple[str, str], tuple[str, str]]:
        (a, b), host = self._ports, self._host
        return (f"tcp://*:{a}", f"tcp://{host}:{a}"), (f"tcp://*:{b}", f"tcp://{host}:{b}")

    def start(self, config: EngineConfig, input_address: str, output_address: str) -> None:
        cpus = config.num_threads or 1
        actor_class = self._ray.remote(num_cpus=cpus)(_RayEngineCore)
        self._actor = actor_class.remote()
        config = dataclasses.replace(config, num_threads=cpus)  # as many threads as CPUs
        self._done = self._actor.run.remote(config, input_address, output_address)

    @property
    def pid(self) -> int | None:
        return None

    def exit_reason(self) -> str | None:
        ready, _ = self._ray.wait([self._done], timeout=0)
        return self._reason() if ready else None

    def _reason(self) -> str:
        try:
            self._ray.get(self._done)
        except Exception as e:  # the actor died (killed, node lost) or the loop raised
            return f"the engine core actor ended: {type(e).__name__}: {e}"
        return "the engine core actor exited"

    def on_exit(self, loop: asyncio.AbstractEventLoop, callback: Callable[[str], None]) -> None:
        def wait() -> None:
            self._ray.wait([self._done], timeout=None)
            reason = self._reason()
            with self._watch_lock:
                if not self._stopping and not loop.is_closed():
                    loop.call_soon_threadsafe(callback, reason)

        threading.Thread(target=wait, name="cenote-ray-core-watch", daemon=True).start()

    async def stop(self, timeout: float) -> None:
        with self._watch_lock:
            self._stopping = True
        if self._done is None:
            return
        ready, _ = await asyncio.to_thread(self._ray.wait, [self._done], timeout=timeout)
        if not ready:
            self._ray.kill(self._actor)


class _RayEngineCore:
    """Runs ``run_engine_core`` inside a Ray actor process."""

    def run(self, config: EngineConfig, input_address: str, output_address: str) -> None:
        run_engine_core(config, input_address, output_address)


def make_launcher(executor: Executor, ray_address: str | None = None) -> CoreLauncher:
    if executor == "ray":
        return RayLauncher(ray_address)
    if executor != "process":
        raise ValueError(f"distributed executor must be 'process' or 'ray', got {executor!r}")
    return ProcessLauncher()


@contextlib.contextmanager
def child_environment(variables: dict[str, str]) -> Iterator[None]:
    """Add ``variables`` (those not set already) to the environment a child process starts
    with, and take them out of this process's environment again as soon as it has started."""
    with _environment_lock:
        added = {k: v for k, v in variables.items() if k not in os.environ}
        os.environ.update(added)
        try:
            yield
        finally:
            for name in added:
                os.environ.pop(name, None)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port
