"""What the benchmarks share: the CPU they name, the lock they run under, their timing loops.

Every benchmark runs as a module from the repository root, under the lock that keeps two
measurements off the same cores:

    flock /tmp/cpu_bench.lock python -m benchmarks.embed_offline --num-texts 300

so ``benchmarks``, ``tests.server_fixture`` and ``tests.factories`` import as packages, with
no ``sys.path`` edits. Results are ratios measured side by side in one sitting; each measured
result has a dated entry in docs/performance.md (command, CPU, table).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

# the advisory lock every benchmark (and every heavy test run) holds while it measures
LOCK_PATH = "/tmp/cpu_bench.lock"
# the checkout the benchmarks run from (``python -m benchmarks.NAME`` in this folder)
REPO_ROOT = Path(__file__).resolve().parents[1]


def cpu_banner(threads: int | None = None) -> str:
    """One line naming the machine: the CPU model, its core count and the vector features the
    kernels and the default dtype depend on (numbers mean nothing without it)."""
    from cenote.kernels import cpu_features, cpu_model

    features = " ".join(cpu_features()) or "no vector features"
    line = f"CPU: {cpu_model()}; {os.cpu_count()} cores; features: {features}"
    return line if threads is None else f"{line}; threads {threads}"


def median_seconds(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """Median wall seconds of ``runs`` calls of ``fn`` after ``warmup`` untimed calls (the
    median, not the mean: a neighbour's burst on a shared box moves it least)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def best_seconds(fn: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Fastest wall seconds of ``repeats`` calls of ``fn`` (for kernels timed in microseconds,
    where a shared machine only ever adds time)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def latency_summary(seconds: list[float]) -> str:
    """p50 / p99 / max of request latencies, in milliseconds, with the sample count."""
    values = sorted(seconds)
    p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
    return (
        f"p50 {1000 * statistics.median(values):7.1f} ms  p99 {1000 * p99:7.1f} ms  "
        f"max {1000 * values[-1]:7.1f} ms  (n={len(values)})"
    )
