"""``/health`` while one client sends the heaviest generation requests the bounds allow: ``cenote
serve`` on the SmolLM2 GGUF.

    flock /tmp/cpu_bench.lock python -m benchmarks.serve_bounds [--probes 60]

Prints the CPU, then p50/p99/max of ``/health`` idle and while a client streams completions back
to back with ``--max-stop-strings`` (64) stop strings of ``--max-stop-chars`` (4,096)
characters, n = 8, 64 tokens each, and what such a request takes; and how fast the server
refuses the 200,000-string list of issue 26 (a 2.2 MB body).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from benchmarks.common import cpu_banner, latency_summary
from benchmarks.serve_fairness import get_health
from tests.server_fixture import ServerProcess


def stop_list(count: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij") for _ in range(length)) for _ in range(count)]


HEAVY = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True,
         "n": 8, "stop": stop_list(64, 64, 0)}  # fmt: skip
HOSTILE = {**HEAVY, "n": 1, "stop": stop_list(200_000, 8, 0)}


async def health_probes(url: str, count: int) -> list[float]:
    times = []
    for _ in range(count):
        times.append(await get_health(url))
        await asyncio.sleep(0.05)
    return times


async def under_load(url: str, count: int) -> tuple[list[float], list[float]]:
    heavy_times: list[float] = []
    stop = asyncio.Event()

    async def heavy_loop() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            while not stop.is_set():
                start = time.perf_counter()
                response = await client.post("/v1/completions", json=HEAVY)
                assert response.status_code == 200, response.text
                heavy_times.append(time.perf_counter() - start)

    task = asyncio.create_task(heavy_loop())
    await asyncio.sleep(0.5)
    health = await health_probes(url, count)
    stop.set()
    await task
    return health, heavy_times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probes", type=int, default=60, help="/health probes per phase")
    args = parser.parse_args()
    from tests.factories.smollm2 import find_smollm2_gguf

    print(cpu_banner())
    server = ServerProcess(str(find_smollm2_gguf()), "--dtype", "float32")
    try:
        idle = asyncio.run(health_probes(server.url, args.probes))
        health, heavy = asyncio.run(under_load(server.url, args.probes))
        start = time.perf_counter()
        refused = httpx.post(f"{server.url}/v1/completions", json=HOSTILE, timeout=300)
        refuse_s = time.perf_counter() - start
    finally:
        server.stop()
    print(f"idle                 /health: {latency_summary(idle)}")
    print(f"heavy stop-list load /health: {latency_summary(health)}")
    print(
        f"heavy request (n=8 x 64 tokens, 64 stop strings, 4,096 chars): {latency_summary(heavy)}"
    )
    print(f"200,000 stop strings: {refused.status_code} in {1000 * refuse_s:.0f} ms")


if __name__ == "__main__":
    main()
