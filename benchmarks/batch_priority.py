"""Interactive embeddings while an online batch runs: ``cenote serve --batch-dir`` (default
model, fp32) latency of one-sentence /v1/embeddings requests

  1) idle,
  2) while a Batch API job runs (its lines at batch priority, --batch-concurrency in flight),
  3) while the same lines arrive as ordinary HTTP requests from as many clients (priority 0:
     what a client-side batch script gets, the queue in arrival order),

and the batch's throughput (lines and texts per second) in 2) and 3).

    flock /tmp/cpu_bench.lock python -m benchmarks.batch_priority [--lines 200] [--small 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import httpx
import openai

from benchmarks.common import cpu_banner, latency_summary
from tests.server_fixture import ServerProcess

TEXTS_PER_LINE = 16
LINE_TEXT = "a passage of a document that a nightly batch job embeds for retrieval " * 3
SMALL = {"input": "a short query about rivers"}


def line_body(i: int) -> dict[str, object]:
    return {"input": [f"{i}-{j} {LINE_TEXT}" for j in range(TEXTS_PER_LINE)]}


async def small_latencies(url: str, count: int, running: asyncio.Event | None) -> list[float]:
    """One request at a time, ``count`` of them (while ``running`` is set, if given)."""
    values = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for _ in range(count):
            if running is not None and not running.is_set():
                break
            start = time.perf_counter()
            answer = await client.post("/v1/embeddings", json=SMALL)
            assert answer.status_code == 200, answer.text
            values.append(time.perf_counter() - start)
            await asyncio.sleep(0.02)
    return values


async def online_batch(server: ServerProcess, num_lines: int, running: asyncio.Event) -> float:
    """Run a Batch API job; its wall time."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
    lines = [
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings",
                    "body": line_body(i)})
        for i in range(num_lines)
    ]  # fmt: skip
    uploaded = await client.files.create(
        file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch"
    )
    start = time.perf_counter()
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    running.set()
    while batch.status not in ("completed", "failed", "cancelled"):
        await asyncio.sleep(0.05)
        batch = await client.batches.retrieve(batch.id)
    running.clear()
    assert batch.status == "completed" and batch.request_counts.completed == num_lines, batch
    return time.perf_counter() - start


async def client_batch(url: str, num_lines: int, workers: int, running: asyncio.Event) -> float:
    """The same lines as plain requests from ``workers`` clients; the wall time."""
    queue = list(range(num_lines))
    start = time.perf_counter()
    running.set()

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            while queue:
                answer = await client.post("/v1/embeddings", json=line_body(queue.pop()))
                assert answer.status_code == 200, answer.text

    await asyncio.gather(*(worker() for _ in range(workers)))
    running.clear()
    return time.perf_counter() - start


async def measure(server: ServerProcess, args: argparse.Namespace) -> None:
    print(f"idle:          {latency_summary(await small_latencies(server.url, args.small, None))}")
    for name in ("batch API", "HTTP clients"):
        running = asyncio.Event()
        if name == "batch API":
            job = asyncio.create_task(online_batch(server, args.lines, running))
        else:
            job = asyncio.create_task(
                client_batch(server.url, args.lines, args.concurrency, running)
            )
        while not running.is_set():
            await asyncio.sleep(0.01)
        latencies = await small_latencies(server.url, 10_000, running)
        wall = await job
        print(
            f"{name + ':':14} {latency_summary(latencies)}   batch: {args.lines / wall:6.1f} lines/s, "
            f"{args.lines * TEXTS_PER_LINE / wall:7.1f} texts/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--small", type=int, default=60, help="idle requests")
    parser.add_argument("--concurrency", type=int, default=4, help="--batch-concurrency")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"{cpu_banner()}; {args.threads} engine threads; {args.lines} lines x {TEXTS_PER_LINE} "
          f"texts; {args.concurrency} lines in flight")  # fmt: skip
    with tempfile.TemporaryDirectory() as batch_dir:
        server = ServerProcess(
            "--dtype", "float32", "--num-threads", str(args.threads), "--batch-dir", batch_dir,
            "--batch-concurrency", str(args.concurrency),
        )  # fmt: skip
        try:
            asyncio.run(measure(server, args))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
