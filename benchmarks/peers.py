"""cenote next to vLLM-CPU, llama.cpp and sentence-transformers on the same work: one table.

Runs the shared peer scripts (``../shared/peers``: the same corpus, prompts and timing rules for
every engine, each timed section under ``flock /tmp/cpu_bench.lock``) for cenote and for every
installed peer, then reads the JSON lines they leave in ``$ROOT/logs`` and prints one table with
ratios, headed by the CPU model and flags it ran on.

    # once (10-25 min): ROOT=~/peers PEERS="models data vllm st llamacpp" bash ../shared/peers/setup_peers.sh
    python benchmarks/peers.py --root ~/peers                  # run everything, then the table
    python benchmarks/peers.py --root ~/peers --only gen       # generation only
    python benchmarks/peers.py --root ~/peers --table-only     # the table of the last runs

Work names (``--only``): ``embed`` (offline MiniLM, 500 chunks), ``http`` (served MiniLM, 1,000
requests of 1-8 chunks at concurrency 16), ``gen`` (SmolLM2 Q4_1 GGUF, 1 stream and 16 streams
x 128 greedy tokens), ``startup`` (launch to /health 200). Nothing else may run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SCRIPTS = REPO.parent / "shared" / "peers"
# our work name -> (peers run_peers_bench.sh names, cenote run_cenote_bench.sh names)
WORK = {
    "embed": ("st vllm", "embed"),
    "http": ("vllm_http", "http"),
    "gen": ("llamacpp vllm_gen", "gen"),
    "startup": ("", "startup"),
}


def cpu_line() -> str:
    from cenote.kernels import cpu_features, cpu_model

    return f"{cpu_model()}, {os.cpu_count()} cores; {' '.join(cpu_features()) or 'no vector flags'}"


def last_json(path: Path, key: str | None = None) -> dict | None:
    """The last JSON line of a log (the one holding ``key`` when given), or None."""
    if not path.exists():
        return None
    found = None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if key is None or key in value:
                found = value
    return found


def pick(logs: Path, name: str, key: str) -> float | None:
    record = last_json(logs / name, key)
    return None if record is None or record.get(key) is None else float(record[key])


def startup_seconds(logs: Path, label: str) -> float | None:
    """Median launch-to-/health time of ``label`` in the start-up logs."""
    values = []
    for name in ("cenote_startup.log", "vllm_startup.log"):
        path = logs / name
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("{") and label in line:
                record = json.loads(line)
                seconds = record.get("ready_s", record.get("startup_s"))
                if seconds is not None:
                    values.append(float(seconds))
    return sorted(values)[len(values) // 2] if values else None


# (work, cenote variant, cenote log, key, peer, peer log, key); start-up rows read start-up logs
# fmt: off
TABLE = [
    ("offline embed, chunks/s", "default dtype", "cenote_embed_auto.log", "sent_per_s_median",
     "vLLM-CPU (auto dtype)", "vllm_auto.log", "sent_per_s_median"),
    ("offline embed, chunks/s", "fp32", "cenote_embed_float32.log", "sent_per_s_median",
     "vLLM-CPU fp32", "vllm_float32.log", "sent_per_s_median"),
    ("offline embed, chunks/s", "fp32", "cenote_embed_float32.log", "sent_per_s_median",
     "sentence-transformers fp32", "st_torch.log", "sent_per_s_median"),
    ("offline embed, chunks/s", "bf16", "cenote_embed_bfloat16.log", "sent_per_s_median",
     "sentence-transformers bf16", "st_torch_bf16.log", "sent_per_s_median"),
    ("offline embed, chunks/s", "bf16", "cenote_embed_bfloat16.log", "sent_per_s_median",
     "vLLM-CPU bf16", "vllm_bfloat16.log", "sent_per_s_median"),
    ("served embed c16, chunks/s", "default dtype", "cenote_http_auto_c16.log",
     "sent_per_s_median", "vllm serve", "vllm_http.log", "sent_per_s_median"),
    ("generate 1 stream, tok/s", "default", "cenote_gen_auto.log", "decode_tok_s_median",
     "llama.cpp, 2 threads", "llama_gen_t2.log", "decode_tok_s_median"),
    ("generate 1 stream, tok/s", "fp32 act.", "cenote_gen_float32.log", "decode_tok_s_median",
     "vLLM-CPU bf16", "vllm_gen_bf16.log", "decode_tok_s_median"),
    ("generate 16 streams, tok/s", "default", "cenote_gen_auto.log", "batch16_gen_tok_s_median",
     "vLLM-CPU bf16", "vllm_gen_bf16.log", "batch16_gen_tok_s_median"),
]
# fmt: on


def rows(logs: Path) -> list[tuple[str, str, float | None, str, float | None]]:
    """(work, variant, cenote, peer name, peer value): higher is better except start-up."""
    found = [
        (work, variant, pick(logs, ours, key), peer, pick(logs, theirs, peer_key))
        for work, variant, ours, key, peer, theirs, peer_key in TABLE
    ]
    cenote_start = startup_seconds(logs, "cenote_serve_default")
    vllm_start = startup_seconds(logs, "vllm_serve_minilm_bf16")
    found.append(
        ("start-up to /health, s (lower)", "MiniLM", cenote_start, "vllm serve", vllm_start)
    )
    return found


def print_table(logs: Path) -> None:
    print(f"CPU: {cpu_line()}")
    print(f"logs: {logs}")
    header = f"{'work':<32}{'cenote':<16}{'value':>9}   {'peer':<28}{'value':>9}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for work, variant, ours, peer, theirs in rows(logs):
        ratio = "-"
        if ours and theirs:
            lower_better = "lower" in work
            ratio = f"{(theirs / ours if lower_better else ours / theirs):.2f}x"
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"{work:<32}{variant:<16}{fmt(ours):>9}   {peer:<28}{fmt(theirs):>9}{ratio:>8}")
    print("ratio: cenote / peer for throughput, peer / cenote for start-up (>1: cenote ahead)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path.home() / "peers",
        help="the folder setup_peers.sh made (venvs, models, data, logs)",
    )
    parser.add_argument(
        "--scripts",
        type=Path,
        default=DEFAULT_SCRIPTS,
        help="the shared peer scripts (run_peers_bench.sh, ...)",
    )
    parser.add_argument("--only", nargs="+", choices=sorted(WORK), default=sorted(WORK))
    parser.add_argument("--skip-peers", action="store_true", help="reuse the peers' last logs")
    parser.add_argument("--table-only", action="store_true", help="print the last runs' table")
    args = parser.parse_args()
    logs = args.root / "logs"
    if not args.table_only:
        env = {**os.environ, "ROOT": str(args.root), "CENOTE_VENV": str(Path(sys.prefix))}
        peers = " ".join(WORK[w][0] for w in args.only if WORK[w][0])
        ours = " ".join(WORK[w][1] for w in args.only)
        if peers and not args.skip_peers:
            subprocess.run(
                ["bash", str(args.scripts / "run_peers_bench.sh")],
                check=False,
                env={**env, "ONLY": peers},
            )
        subprocess.run(
            ["bash", str(args.scripts / "run_cenote_bench.sh")],
            check=False,
            env={**env, "ONLY": ours},
        )
    print_table(logs)


if __name__ == "__main__":
    main()
