"""Kernel builds take turns through an advisory lock that dies with its holder: a build killed
midway (a server stopped while its engine core compiled) never leaves the next one waiting on
torch's lock file forever."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from cenote.kernels.build import _build_turn

_HOLD = """
import sys, time
from pathlib import Path
from cenote.kernels.build import _build_turn
with _build_turn(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "lock").write_text("a build in progress")  # torch's baton
    print("holding", flush=True)
    time.sleep(600)
"""


def _take_turn_in_a_thread(build_dir: Path) -> threading.Event:
    entered = threading.Event()

    def take_turn() -> None:
        with _build_turn(build_dir):
            entered.set()

    threading.Thread(target=take_turn, daemon=True).start()
    return entered


def test_a_killed_builders_turn_and_lock_file_are_released(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        entered = _take_turn_in_a_thread(tmp_path)
        assert not entered.wait(0.5), "a live builder's turn was not respected"
        assert (tmp_path / "lock").exists()
    finally:
        holder.kill()  # SIGKILL: no clean-up runs in the holder; its lock file stays
        holder.wait()
    assert entered.wait(10), "the killed builder's turn was never released"
    assert not (tmp_path / "lock").exists()


def test_turns_are_taken_one_at_a_time(tmp_path: Path) -> None:
    inside, most = 0, 0
    guard = threading.Lock()

    def build() -> None:
        nonlocal inside, most
        with _build_turn(tmp_path):
            with guard:
                inside += 1
                most = max(most, inside)
            time.sleep(0.05)
            with guard:
                inside -= 1

    threads = [threading.Thread(target=build) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert most == 1
