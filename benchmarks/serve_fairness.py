"""Small requests while a maximal one runs: ``cenote serve`` (default model) latency under a
request of --max-request-tokens (65,536) tokens.

    flock /tmp/cpu_bench.lock python -m benchmarks.serve_fairness [--small 60] [--dtype auto]

Prints the CPU, then p50/p99/max latency of one-sentence embeddings and of /health, idle and
while maximal requests (256 inputs x 256 tokens) run back to back, and how long a maximal request
takes. The scheduler keeps about one short step of a big request's tokens in its queue
(``scheduler/group_shares.py``), so a small one waits for about one step, not for the whole big
request.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import msgspec

from benchmarks.common import cpu_banner, latency_summary
from benchmarks.serve_embed import _Connection
from tests.server_fixture import ServerProcess

BIG = msgspec.json.encode({"input": ["word " * 300] * 256, "truncate_prompt_tokens": -1})
SMALL = msgspec.json.encode({"input": "a short query about rivers"})


async def get_health(url: str) -> float:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    start = time.perf_counter()
    writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    status = await reader.readline()
    await reader.read()
    writer.close()
    assert b" 200 " in status, status
    return time.perf_counter() - start


async def probe(url: str, count: int) -> tuple[list[float], list[float]]:
    """``count`` small embeddings one after another, each followed by a /health."""
    connection = await _Connection.open(url)
    small, health = [], []
    try:
        for _ in range(count):
            start = time.perf_counter()
            await connection.post_json("/v1/embeddings", SMALL)
            small.append(time.perf_counter() - start)
            health.append(await get_health(url))
            await asyncio.sleep(0.05)
    finally:
        connection.close()
    return small, health


async def under_load(url: str, count: int) -> tuple[list[float], list[float], list[float]]:
    big_times: list[float] = []
    stop = asyncio.Event()

    async def big_loop() -> None:
        connection = await _Connection.open(url)
        try:
            while not stop.is_set():
                start = time.perf_counter()
                await connection.post_json("/v1/embeddings", BIG)
                big_times.append(time.perf_counter() - start)
        finally:
            connection.close()

    task = asyncio.create_task(big_loop())
    await asyncio.sleep(0.5)
    small, health = await probe(url, count)
    stop.set()
    await task
    return small, health, big_times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=int, default=60, help="small requests per phase")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    print(cpu_banner())
    server = ServerProcess("--dtype", args.dtype)
    try:
        asyncio.run(probe(server.url, 5))  # warm-up
        idle_small, idle_health = asyncio.run(probe(server.url, args.small))
        small, health, big = asyncio.run(under_load(server.url, args.small))
    finally:
        server.stop()
    print(f"idle       small embed: {latency_summary(idle_small)}")
    print(f"idle       /health    : {latency_summary(idle_health)}")
    print(f"under load small embed: {latency_summary(small)}")
    print(f"under load /health    : {latency_summary(health)}")
    print(f"maximal request (65,536 tokens): {latency_summary(big)}")


if __name__ == "__main__":
    main()
