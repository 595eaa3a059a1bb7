"""cenote next to vLLM-CPU, llama.cpp and sentence-transformers on the same work: one table.

Runs the shared peer scripts (``../shared/peers``: the same corpus, prompts and timing rules for
every engine, each timed section under ``flock /tmp/cpu_bench.lock``) for cenote and for every
installed peer, then reads the JSON lines they leave in ``$ROOT/logs`` and prints one table with
ratios, headed by the CPU model and flags it ran on: every peer of a row, then each row against
its best peer (offline embedding: vLLM-CPU, sentence-transformers' torch, ONNX and OpenVINO back
ends, fastembed; served: vLLM, Infinity; generation: llama.cpp, vLLM).

    # once (10-25 min): ROOT=~/peers PEERS="models data vllm st llamacpp" bash ../shared/peers/setup_peers.sh
    python -m benchmarks.peers --root ~/peers                  # run everything, then the table
    python -m benchmarks.peers --root ~/peers --only gen       # generation only
    python -m benchmarks.peers --root ~/peers --table-only     # the table of the last runs

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
    "embed": ("st vllm fastembed", "embed"),
    "http": ("vllm_http infinity_http", "http"),
    "gen": ("llamacpp vllm_gen", "gen"),
    "startup": ("", "startup"),
}
# run_peers_bench.sh name -> the venv setup_peers.sh makes for it (a peer not set up is skipped)
PEER_VENV = {
    "st": "st",
    "vllm": "vllm",
    "vllm_http": "vllm",
    "vllm_gen": "vllm",
    "infinity_http": "infinity",
    "llamacpp": "llamacpp",
    "fastembed": "fastembed",
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


# One row per work and cenote variant: (work, variant, cenote log, key, peers), each peer
# (name, log, key). Every peer of a row did the same work; the row's ratio is against the best.
Peer = tuple[str, str, str]
EMBED_KEY = "sent_per_s_median"
FP32_EMBED_PEERS: list[Peer] = [
    ("vLLM-CPU fp32", "vllm_float32.log", EMBED_KEY),
    ("sentence-transformers torch fp32", "st_torch.log", EMBED_KEY),
    ("sentence-transformers ONNX", "st_onnx.log", EMBED_KEY),
    ("sentence-transformers OpenVINO", "st_openvino.log", EMBED_KEY),
    ("fastembed (ONNX)", "fastembed.log", EMBED_KEY),
]
BF16_EMBED_PEERS: list[Peer] = [
    ("vLLM-CPU bf16", "vllm_bfloat16.log", EMBED_KEY),
    ("sentence-transformers torch bf16", "st_torch_bf16.log", EMBED_KEY),
]
# fmt: off
TABLE: list[tuple[str, str, str, str, list[Peer]]] = [
    ("offline embed, chunks/s", "default dtype", "cenote_embed_auto.log", EMBED_KEY,
     [("vLLM-CPU (auto dtype)", "vllm_auto.log", EMBED_KEY), *FP32_EMBED_PEERS,
      *BF16_EMBED_PEERS]),
    ("offline embed, chunks/s", "fp32", "cenote_embed_float32.log", EMBED_KEY, FP32_EMBED_PEERS),
    ("offline embed, chunks/s", "bf16", "cenote_embed_bfloat16.log", EMBED_KEY, BF16_EMBED_PEERS),
    ("served embed c16, chunks/s", "default dtype", "cenote_http_auto_c16.log", EMBED_KEY,
     [("vllm serve", "vllm_http.log", EMBED_KEY),
      ("infinity fp32", "infinity_http_float32.log", EMBED_KEY),
      ("infinity bf16", "infinity_http_bfloat16.log", EMBED_KEY)]),
    ("generate 1 stream, tok/s", "default", "cenote_gen_auto.log", "decode_tok_s_median",
     [("llama.cpp, 2 threads", "llama_gen_t2.log", "decode_tok_s_median"),
      ("vLLM-CPU bf16", "vllm_gen_bf16.log", "decode_tok_s_median")]),
    ("generate 1 stream, tok/s", "fp32 act.", "cenote_gen_float32.log", "decode_tok_s_median",
     [("llama.cpp, 2 threads", "llama_gen_t2.log", "decode_tok_s_median")]),
    ("generate 16 streams, tok/s", "default", "cenote_gen_auto.log", "batch16_gen_tok_s_median",
     [("vLLM-CPU bf16", "vllm_gen_bf16.log", "batch16_gen_tok_s_median")]),
]
# fmt: on
Row = tuple[str, str, float | None, list[tuple[str, float | None]]]


def rows(logs: Path) -> list[Row]:
    """(work, variant, cenote, [(peer, value)]): higher is better except start-up."""
    found: list[Row] = [
        (
            work,
            variant,
            pick(logs, ours, key),
            [(peer, pick(logs, theirs, peer_key)) for peer, theirs, peer_key in peers],
        )
        for work, variant, ours, key, peers in TABLE
    ]
    cenote_start = startup_seconds(logs, "cenote_serve_default")
    vllm_start = startup_seconds(logs, "vllm_serve_minilm_bf16")
    found.append(
        ("start-up to /health, s (lower)", "MiniLM", cenote_start, [("vllm serve", vllm_start)])
    )
    return found


def ratio(work: str, ours: float | None, theirs: float | None) -> float | None:
    """cenote / peer for throughput, peer / cenote where lower is better (>1: cenote ahead)."""
    if not ours or not theirs:
        return None
    return theirs / ours if "lower" in work else ours / theirs


def best_peer(work: str, peers: list[tuple[str, float | None]]) -> tuple[str, float] | None:
    """The row's strongest peer that ran: the highest throughput, the lowest start-up."""
    ran = [(name, value) for name, value in peers if value]
    if not ran:
        return None
    choose = min if "lower" in work else max
    return choose(ran, key=lambda item: item[1])


def print_table(logs: Path) -> None:
    print(f"CPU: {cpu_line()}")
    print(f"logs: {logs}")
    header = f"{'work':<32}{'cenote':<16}{'value':>9}   {'peer':<34}{'value':>9}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    summary = []
    for work, variant, ours, peers in rows(logs):
        for i, (peer, theirs) in enumerate(peers):
            r = ratio(work, ours, theirs)
            left = (work, variant, fmt(ours)) if i == 0 else ("", "", "")
            shown = "-" if r is None else f"{r:.2f}x"
            print(f"{left[0]:<32}{left[1]:<16}{left[2]:>9}   {peer:<34}{fmt(theirs):>9}{shown:>8}")
        best = best_peer(work, peers)
        if best is not None:
            r = ratio(work, ours, best[1])
            summary.append((work, variant, best[0], "-" if r is None else f"{r:.2f}x"))
    print()
    print("against the best peer of each row:")
    for work, variant, peer, shown in summary:
        print(f"  {work:<32}{variant:<16}{peer:<34}{shown:>8}")
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
        wanted = [name for w in args.only for name in WORK[w][0].split()]
        missing = [n for n in wanted if not (args.root / "venvs" / PEER_VENV[n]).is_dir()]
        if missing:
            print(f"not set up under {args.root / 'venvs'} (skipped): {' '.join(missing)}")
        peers = " ".join(n for n in wanted if n not in missing)
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
