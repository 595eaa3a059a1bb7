"""Served vs offline embedding throughput: ``cenote serve`` (default model) under an async client.

    python -m benchmarks.serve_embed [--requests 256] [--concurrency 1 16 64] [--dtype auto]
        [--repeat-share 0.3] [--embedding-cache-size 10000] [--no-offline]

Starts its own server, sends 1-8 sentences per request at each concurrency (new sentences for
each concurrency, so one run's inputs are no cache hits in the next; ``--repeat-share``: that
share of requests, seeded, repeats an earlier request of the same run), prints requests/s,
sentences/s, p50/p99 latency, the in-process ``LLM.embed`` throughput on the same sentences (the
ceiling) and the ratio served/offline, and the server's embedding cache hits and misses.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import time

import msgspec

from tests.server_fixture import ServerProcess

_WORDS = (
    "the a model server request token vector cat dog river mountain quick brown fox jumps over "
    "lazy engine batch latency throughput embedding sentence search query document answer"
).split()


def make_batches(num_requests: int, seed: int = 0, repeat_share: float = 0.0) -> list[list[str]]:
    """``repeat_share`` of the requests (after the first) repeat an earlier one's sentences."""
    rng = random.Random(seed)
    batches: list[list[str]] = []
    for _ in range(num_requests):
        if batches and rng.random() < repeat_share:
            batches.append(list(rng.choice(batches)))
            continue
        size = rng.randint(1, 8)
        batches.append([" ".join(rng.choices(_WORDS, k=rng.randint(6, 24))) for _ in range(size)])
    return batches


def cache_counts(url: str) -> str:
    """The server's embedding cache hits and misses so far (``/metrics``)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    counts = {}
    for name in ("hits", "misses"):
        match = re.search(rf"^cenote_embedding_cache_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        counts[name] = int(float(match.group(1))) if match else 0
    return f"embedding cache: {counts['hits']} hits, {counts['misses']} misses"


class _Connection:
    """A keep-alive HTTP/1.1 connection that posts JSON and reads one response at a time.

    Hand-written on asyncio streams, not httpx: at concurrency 64 httpx's own bookkeeping took
    a third of a core on this 2-core machine, CPU the server under test then lacked. The load
    generator should measure the server, not itself."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> _Connection:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, f"{host}:{port}")

    async def post_json(self, path: str, body: bytes) -> bytes:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = await self.reader.readexactly(length)
        if b" 200 " not in status_line:
            raise RuntimeError(f"{status_line.decode().strip()}: {payload[:200]!r}")
        return payload

    def close(self) -> None:
        self.writer.close()


async def run_load(url: str, batches: list[list[str]], concurrency: int) -> dict[str, float]:
    latencies: list[float] = []
    queue: asyncio.Queue = asyncio.Queue()
    for batch in batches:
        queue.put_nowait(msgspec.json.encode({"input": batch}))

    async def worker() -> None:
        connection = await _Connection.open(url)
        try:
            while not queue.empty():
                body = queue.get_nowait()
                start = time.perf_counter()
                response = msgspec.json.decode(await connection.post_json("/v1/embeddings", body))
                assert response["data"], "no embeddings in the response"
                latencies.append(time.perf_counter() - start)
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "requests_per_s": len(batches) / elapsed,
        "sentences_per_s": sum(len(b) for b in batches) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def offline_throughput(batches: list[list[str]], dtype: str) -> float:
    """Sentences/s of in-process ``LLM.embed`` on all sentences at once (the ceiling)."""
    from cenote import LLM

    llm = LLM(dtype=dtype)
    sentences = [s for b in batches for s in b]
    llm.embed(sentences[:64], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.embed(sentences, use_tqdm=False)
    return len(sentences) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeat-share", type=float, default=0.0)
    parser.add_argument("--embedding-cache-size", default="0")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline ceiling")
    args = parser.parse_args()
    from cenote.kernels import cpu_features, cpu_model

    print(f"CPU: {cpu_model()}; features: {' '.join(cpu_features())}")
    runs = {
        c: make_batches(args.requests, seed, args.repeat_share)
        for seed, c in enumerate(args.concurrency, start=1)
    }
    server = ServerProcess(
        "--dtype", args.dtype, "--embedding-cache-size", args.embedding_cache_size
    )  # fmt: skip
    try:
        asyncio.run(run_load(server.url, make_batches(16, seed=0), 4))  # warm-up
        results = {c: asyncio.run(run_load(server.url, runs[c], c)) for c in args.concurrency}
        counts = cache_counts(server.url)
    finally:
        server.stop()
    batches = runs[args.concurrency[0]]
    ceiling = None if args.no_offline else offline_throughput(batches, args.dtype)
    print(
        f"repeat share {args.repeat_share}, --embedding-cache-size {args.embedding_cache_size}; "
        + counts
    )
    if ceiling is not None:
        print(f"offline LLM.embed: {ceiling:.1f} sentences/s ({args.dtype})")
    print(f"{'conc':>5} {'req/s':>8} {'sent/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ratio':>6}")
    for concurrency, r in results.items():
        ratio = f"{r['sentences_per_s'] / ceiling:>6.2f}" if ceiling is not None else f"{'-':>6}"
        print(
            f"{concurrency:>5} {r['requests_per_s']:>8.1f} {r['sentences_per_s']:>8.1f} "
            f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {ratio}"
        )


if __name__ == "__main__":
    main()
