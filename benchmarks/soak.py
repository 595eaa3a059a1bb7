"""Memory over time: ``cenote serve`` on the SmolLM2 GGUF under a mixed load for ``--minutes``,
the engine core's and the front's resident memory sampled as it runs.

    flock /tmp/cpu_bench.lock python -m benchmarks.soak [--minutes 30] [--clients 8]
        [--keep-step-memory 1|0] [--every 30]

Half the clients embed 1-8 sentences a request, half chat (64 tokens, every third one with
``top_logprobs: 5``). Prints the CPU, then one line per sample: minutes, core RSS, front RSS,
requests answered (and any that were not 200). ``--keep-step-memory 0`` starts the core with
``CENOTE_KEEP_STEP_MEMORY=0`` (glibc's default trimming), to tell memory kept by design from
growth.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path

import httpx

from benchmarks.common import cpu_banner
from tests.server_fixture import ServerProcess

WORDS = "river stone light quiet garden number paper window music answer".split()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def client(url: str, index: int, deadline: float, counts: dict[str, int]) -> None:
    rng = random.Random(index)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        turn = 0
        while time.monotonic() < deadline:
            turn += 1
            if index % 2 == 0:
                texts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 40)))
                         for _ in range(rng.randint(1, 8))]  # fmt: skip
                response = await http.post("/v1/embeddings", json={"input": texts})
            else:
                content = " ".join(rng.choices(WORDS, k=rng.randint(3, 60)))
                body = {"messages": [{"role": "user", "content": content}], "max_tokens": 64,
                        "temperature": 0.8, "seed": turn}  # fmt: skip
                if turn % 3 == 0:
                    body.update(logprobs=True, top_logprobs=5)
                response = await http.post("/v1/chat/completions", json=body)
            key = "ok" if response.status_code == 200 else f"status {response.status_code}"
            counts[key] = counts.get(key, 0) + 1


async def soak(server: ServerProcess, minutes: float, clients: int, every: float) -> None:
    core, front = server.engine_pid(), server.process.pid
    start = time.monotonic()
    deadline = start + 60 * minutes
    counts: dict[str, int] = {}
    tasks = [asyncio.create_task(client(server.url, i, deadline, counts)) for i in range(clients)]
    print(f"{0:6.1f} min  core {rss_mb(core):7.0f} MB  front {rss_mb(front):6.0f} MB  (start)")
    while time.monotonic() < deadline:
        await asyncio.sleep(min(every, max(deadline - time.monotonic(), 0.1)))
        elapsed = (time.monotonic() - start) / 60
        print(f"{elapsed:6.1f} min  core {rss_mb(core):7.0f} MB  front {rss_mb(front):6.0f} MB  "
              f"{counts}", flush=True)  # fmt: skip
    await asyncio.gather(*tasks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--keep-step-memory", choices=["1", "0"], default="1")
    parser.add_argument("--every", type=float, default=30, help="seconds between samples")
    args = parser.parse_args()
    from tests.factories.smollm2 import find_smollm2_gguf

    os.environ["CENOTE_KEEP_STEP_MEMORY"] = args.keep_step_memory
    print(cpu_banner(), f"| CENOTE_KEEP_STEP_MEMORY={args.keep_step_memory}")
    server = ServerProcess(str(find_smollm2_gguf()), "--dtype", "float32")
    try:
        asyncio.run(soak(server, args.minutes, args.clients, args.every))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
