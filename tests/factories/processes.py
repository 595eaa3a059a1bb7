"""Command-line runs measured: exit status, output and the child's own peak memory."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    peak_rss_mib: float  # the child's peak resident memory (getrusage of that child alone)


def run_cenote(args: list[str], folder: Path) -> Finished:
    """``python -m cenote ARGS`` to its end; its output goes through files in ``folder``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out, err = folder / "cenote.stdout", folder / "cenote.stderr"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "cenote", *args], env=env, stdout=stdout, stderr=stderr
        )
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    return Finished(
        process.returncode,
        out.read_text(),
        err.read_text(),
        usage.ru_maxrss / 1024,  # KiB on Linux
    )
