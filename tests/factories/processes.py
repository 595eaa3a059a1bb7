"""Command-line runs measured: exit status, output and the child's own peak memory."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# runs ``cenote ARGS`` and writes its peak resident memory (kB) at exit; read by the process
# itself because a child's rusage also counts the parent's memory it was forked from
_MEASURED = """
import atexit, runpy, sys
report = sys.argv.pop(1)
def peak():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    with open(report, "w") as out:
        out.write(line.split()[1])
atexit.register(peak)
runpy.run_module("cenote", run_name="__main__", alter_sys=True)
"""


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    peak_rss_mib: float  # the process's peak resident memory (VmHWM)


def run_cenote(args: list[str], folder: Path) -> Finished:
    """``python -m cenote ARGS`` to its end, measured; scratch files go in ``folder``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    report = folder / "cenote.peak"
    done = subprocess.run(
        [sys.executable, "-c", _MEASURED, str(report), *args],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    peak_kib = int(report.read_text())
    report.unlink()
    return Finished(done.returncode, done.stdout, done.stderr, peak_kib / 1024)
