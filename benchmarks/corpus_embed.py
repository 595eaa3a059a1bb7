"""Corpus embedding throughput: ``LLM.embed`` in one process vs the ``cenote embed`` CLI vs the
same job through Ray Data (2 workers x 1 CPU, and 1 worker x all CPUs) vs ``cenote serve`` with
one engine core and with two (``--data-parallel-size 2``), side by side, on the same machine,
model, dtype and passages. Prints the CPU, passages/s and tokens/s, and the
ratios to ``LLM.embed`` (goals: CLI >= 0.95x, Ray >= 0.9x on the same cores).

    flock /tmp/cpu_bench.lock .venv/bin/python -m benchmarks.corpus_embed --num-passages 10000

``LLM.embed`` is timed from a loaded model; the CLI and Ray runs are timed end to end (process
start, model load, Ray start, reading JSONL, writing Parquet parts), as a user sees them; the
served runs end to end from launch, and ("job s") their requests alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from benchmarks.common import cpu_banner
from benchmarks.embed_offline import PROSE


def make_passages(num: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    words = PROSE.split()
    rng = random.Random(seed)
    passages = []
    for _ in range(num):
        start, n = rng.randrange(len(words)), rng.randint(min_words, max_words)
        passages.append(" ".join(words[(start + i) % len(words)] for i in range(n)))
    return passages


def time_llm_embed(passages: list[str], dtype: str) -> tuple[float, int]:
    from cenote import LLM

    llm = LLM(dtype=dtype)
    llm.embed(passages[:64], use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.embed(passages, truncate_prompt_tokens=-1, use_tqdm=False)
    seconds = time.perf_counter() - started
    return seconds, sum(len(o.prompt_token_ids) for o in outputs)


def time_cli(corpus: Path, output: Path, dtype: str, *extra: str) -> tuple[float, float]:
    """(wall seconds of the command, the job's own seconds as it reports them: from opening
    the output, model load included; interpreter start and Ray start excluded)."""
    command = [
        sys.executable, "-m", "cenote", "embed", str(corpus), "-o", str(output), "--dtype", dtype,
        "--truncate", "--no-progress", *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    print(f"    {done.stdout.strip()}")
    return seconds, float(re.search(r"tokens in ([0-9.]+) s", done.stdout)[1])


def time_served(passages: list[str], dtype: str, data_parallel_size: int) -> tuple[float, float]:
    """(wall seconds from launching ``cenote serve --data-parallel-size N`` to the last answer,
    seconds of the embedding requests alone): the corpus posted 32 passages a request, 8 requests
    at a time, through lean keep-alive connections."""
    import asyncio

    import msgspec

    from benchmarks.serve_embed import _Connection
    from tests.server_fixture import ServerProcess

    bodies = [
        msgspec.json.encode({"input": passages[i : i + 32], "truncate_prompt_tokens": -1})
        for i in range(0, len(passages), 32)
    ]

    async def post_all(url: str) -> None:
        queue = list(reversed(bodies))

        async def worker() -> None:
            connection = await _Connection.open(url)
            try:
                while queue:
                    await connection.post_json("/v1/embeddings", queue.pop())
            finally:
                connection.close()

        await asyncio.gather(*(worker() for _ in range(8)))

    launched = time.perf_counter()
    server = ServerProcess("--dtype", dtype, "--data-parallel-size", str(data_parallel_size))
    try:
        started = time.perf_counter()
        asyncio.run(post_all(server.url))
        finished = time.perf_counter()
    finally:
        server.stop()
    return finished - launched, finished - started


def time_driver_alone(corpus: Path, output: Path, dim: int = 384) -> float:
    """The job without a model: read the JSONL, cut parts, write Parquet parts and the manifest
    (random vectors, which do not compress). Its rate is what one driver can feed: the ceiling
    of ``--ray`` scale-out."""
    import numpy as np

    from cenote.apps.corpus.job import EmbedJob, chunk_ids, run_embed_job
    from cenote.apps.corpus.parts import PartResult
    from cenote.apps.corpus.readers import open_source

    vectors = np.random.default_rng(0).standard_normal((1024, dim), dtype=np.float32)

    def random_vectors(chunks):
        for chunk in chunks:
            n = len(chunk.texts)
            embeddings = np.resize(vectors, (n, dim))
            yield chunk, PartResult(chunk_ids(chunk), embeddings, np.ones(n, np.int32))

    job = EmbedJob(source=open_source(corpus), output=output, progress=False)
    started = time.perf_counter()
    run_embed_job(job, random_vectors)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-passages", type=int, default=10_000)
    parser.add_argument("--min-words", type=int, default=20)
    parser.add_argument("--max-words", type=int, default=80)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    args = parser.parse_args()

    passages = make_passages(args.num_passages, args.min_words, args.max_words)
    print(cpu_banner())
    print(
        f"corpus: {len(passages)} passages of {args.min_words}-{args.max_words} words; "
        f"model all-MiniLM-L6-v2, dtype {args.dtype}"
    )
    work = Path(tempfile.mkdtemp(prefix="cenote-corpus-bench-"))
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": p}) + "\n" for p in passages))

    results: dict[str, tuple[float, float]] = {}
    seconds, num_tokens = time_llm_embed(passages, args.dtype)
    results["LLM.embed (loaded model)"] = (seconds, seconds)
    print(f"  LLM.embed: {seconds:.1f} s, {num_tokens} tokens")
    results["cenote embed CLI (end to end)"] = time_cli(corpus, work / "cli", args.dtype)
    if not args.skip_ray:
        results["cenote embed --ray, 2 workers x 1 CPU"] = time_cli(
            corpus, work / "ray2", args.dtype, "--ray", "--ray-workers", "2",
            "--ray-cpus-per-worker", "1",
        )  # fmt: skip
        results["cenote embed --ray, 1 worker x all CPUs"] = time_cli(
            corpus, work / "ray1", args.dtype, "--ray", "--ray-workers", "1",
            "--ray-cpus-per-worker", str(os.cpu_count()),
        )  # fmt: skip

    if not args.skip_serve:
        for size in (1, 2):
            name = f"cenote serve, data parallel {size}"
            results[name] = time_served(passages, args.dtype, size)
            print(f"  {name}: {results[name][1]:.1f} s of requests")

    driver = time_driver_alone(corpus, work / "driver")
    print(
        f"  driver alone (read + write parts, no model): {len(passages) / driver:,.0f} passages/s"
    )

    base = results["LLM.embed (loaded model)"][0]
    print(
        f"\n{'path':40s} {'wall s':>7s} {'passages/s':>10s} {'tokens/s':>8s} {'ratio':>6s} "
        f"{'job s':>6s} {'job ratio':>9s}"
    )
    for name, (seconds, job_seconds) in results.items():
        print(
            f"{name:40s} {seconds:7.1f} {len(passages) / seconds:10.1f} "
            f"{num_tokens / seconds:8.0f} {base / seconds:6.2f} {job_seconds:6.1f} "
            f"{base / job_seconds:9.2f}"
        )


if __name__ == "__main__":
    main()
