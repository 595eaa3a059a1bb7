"""A real ``cenote serve`` subprocess on a free port; always stopped, even if the test run dies."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """The server gets SIGTERM if the test process dies without cleaning up (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    def __init__(self, *args: str, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="cenote-serve-", suffix=".log")[1])
        command = [sys.executable, "-m", "cenote", "serve", *args, "--port", str(self.port)]
        if api_key:
            command += ["--api-key", api_key]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "CENOTE_API_KEY": ""}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def num_steps(self) -> int:
        """Engine steps that scheduled tokens so far (all cores), from ``/metrics``."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        name = "cenote_scheduled_tokens_per_step_count"
        match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
        return int(float(match.group(1))) if match else 0

    def wait_for_steps(self, after: int, timeout_s: float = 60.0) -> None:
        """Until the engine has run a step more than ``after`` (``num_steps()`` read before a
        request was sent): the request reached the engine. In async tests:
        ``await asyncio.to_thread(server.wait_for_steps, before)``."""
        wait_until(lambda: self.num_steps() > after, "an engine step", timeout_s)

    def engine_pid(self) -> int:
        """The (first) engine-core child (not multiprocessing's resource tracker)."""
        return self.engine_pids()[0]

    def engine_pids(self) -> list[int]:
        """Every engine-core child, in start order (data parallel: one per core)."""
        pids = []
        for child in sorted(_children(self.process.pid)):
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                pids.append(child)
        if not pids:
            raise RuntimeError("no engine-core process found")
        return pids

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, then SIGKILL to the whole process group; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        return self.process.returncode


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` until it holds: a test waits for a state, never for a fixed time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s} s")
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        children.extend(int(c) for c in text)
    return children
