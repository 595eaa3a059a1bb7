"""Attention alone, old vs new, at the shapes of the real workloads.

Encoder batches: all-MiniLM-L6-v2's attention (12 heads x 32) over the steps that
``LLM.embed`` makes of a mixed-length corpus (embed_offline's, or ``--data`` JSONL such as
../shared/peers' sentences), 6 layers: the old loop of one SDPA call per run of equal-length
requests against the one varlen kernel call per layer. Decode batches: SmolLM2-135M's attention (9 heads,
3 KV heads x 64, 16-token blocks, 30 layers) for S streams at a context length: the old gather of
every padded block table against the C++ kernel reading blocks in place, and the kernel's 30 calls
alone. Prints the CPU it ran on.

    flock /tmp/cpu_bench.lock .venv/bin/python -m benchmarks.experiments.attention
    flock /tmp/cpu_bench.lock .venv/bin/python -m benchmarks.experiments.attention \
        --data ~/peers/data/sentences.jsonl --dtypes float32
    flock /tmp/cpu_bench.lock .venv/bin/python -m benchmarks.experiments.attention --parts decode \
        --streams 16 --contexts 64,128,256
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from benchmarks.common import cpu_banner
from benchmarks.embed_offline import make_corpus
from cenote.forward_context import AttentionMetadata, forward_context
from cenote.kernels import attention_ops
from cenote.kernels.ops import use_torch
from cenote.models.layers.attention import Attention, kv_cache_shape

ENCODER = dict(heads=12, dim=32, layers=6, budget=8192, truncate=256)  # all-MiniLM-L6-v2
DECODER = dict(heads=9, kv_heads=3, dim=64, layers=30, block_size=16)  # SmolLM2-135M


def median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    """Median milliseconds of ``fn()`` over blocks of runs filling ``min_run_time`` seconds."""
    fn()  # warm-up
    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def _cell(value: object) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.2f}" if value == 0 or abs(value) >= 0.01 else f"{value:.1e}"


def print_table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    widths = [max(9, len(column)) for column in columns]
    lines = [" ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    for row in rows:
        cells = [_cell(c) for c in row]
        lines.append(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    print(f"\n{title}\n" + "\n".join(lines), flush=True)


# ---- encoder ---------------------------------------------------------------------------------


def chunk_lengths(data: str | None, num_texts: int) -> list[int]:
    """Token counts (truncated) of the corpus, as the MiniLM tokenizer cuts them."""
    from tokenizers import Tokenizer

    from cenote.config import default_model_path

    texts = (
        [json.loads(line)["text"] for line in open(data, encoding="utf-8")]
        if data
        else make_corpus(num_texts)
    )
    tokenizer = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return [min(len(e.ids), ENCODER["truncate"]) for e in tokenizer.encode_batch(texts)]


def steps_of(lengths: list[int], budget: int) -> list[list[int]]:
    """The scheduler's steps: requests in order, up to ``budget`` tokens each."""
    steps, current = [], []
    for n in lengths:
        if current and sum(current) + n > budget:
            steps.append(current)
            current = []
        current.append(n)
    return [*steps, current]


def old_encoder(q, k, v, lengths, heads, dim):
    """The attention before length buckets: one SDPA call per run of equal-length requests."""
    out = torch.empty_like(q)
    start, i = 0, 0
    while i < len(lengths):
        j = i
        while j + 1 < len(lengths) and lengths[j + 1] == lengths[i]:
            j += 1
        n, count = lengths[i], j - i + 1
        rows = slice(start, start + n * count)
        shaped = [t[rows].view(count, n, heads, dim).transpose(1, 2) for t in (q, k, v)]
        result = F.scaled_dot_product_attention(*shaped, scale=dim**-0.5)
        out[rows] = result.transpose(1, 2).reshape(n * count, heads * dim)
        start, i = start + n * count, j + 1
    return out


def bench_encoder(lengths: list[int], dtype: torch.dtype, min_run_time: float) -> list[object]:
    heads, dim, layers = ENCODER["heads"], ENCODER["dim"], ENCODER["layers"]
    attention = Attention(heads, dim, heads, 0, dim**-0.5)
    steps = []
    generator = torch.Generator().manual_seed(0)
    for step in steps_of(lengths, ENCODER["budget"]):
        q, k, v = (torch.randn(sum(step), heads * dim, generator=generator) for _ in range(3))
        loc = [0]
        for n in step:
            loc.append(loc[-1] + n)
        steps.append((q.to(dtype), k.to(dtype), v.to(dtype), step, loc))

    def old() -> list[torch.Tensor]:
        outs = []
        for q, k, v, step, _ in steps:
            for _ in range(layers):
                out = old_encoder(q, k, v, step, heads, dim)
            outs.append(out)
        return outs

    def new() -> list[torch.Tensor]:
        outs = []
        for q, k, v, step, loc in steps:
            metadata = AttentionMetadata(loc, step, causal=False)  # the plan: once per step
            with forward_context(metadata):
                for _ in range(layers):
                    out = attention(q, k, v)
            outs.append(out)
        return outs

    diff = max(float((a - b).abs().max()) for a, b in zip(old(), new(), strict=True))
    old_calls = sum(
        1 + sum(a != b for a, b in zip(s, s[1:], strict=False)) for _, _, _, s, _ in steps
    )
    new_calls = len(steps)
    old_ms, new_ms = median_ms(old, min_run_time), median_ms(new, min_run_time)
    name = str(dtype).removeprefix("torch.")
    calls = [old_calls * layers, new_calls * layers]
    return [name, len(lengths), sum(lengths), len(steps), *calls, old_ms, new_ms, diff]


# ---- decode ----------------------------------------------------------------------------------


def bench_decode(
    streams: int, context: int, dtype: torch.dtype, min_run_time: float
) -> list[object]:
    heads, kv_heads, dim = DECODER["heads"], DECODER["kv_heads"], DECODER["dim"]
    layers, size = DECODER["layers"], DECODER["block_size"]
    width = -(-context // size)
    num_blocks = streams * width + 1
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(kv_cache_shape(num_blocks, size, kv_heads, dim), generator=generator)
    cache = cache.to(dtype)
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # scattered blocks
    tables = order.view(streams, width).tolist()
    q = torch.randn(streams, heads * dim, generator=generator).to(dtype)
    k = torch.randn(streams, kv_heads * dim, generator=generator).to(dtype)
    v = torch.randn(streams, kv_heads * dim, generator=generator).to(dtype)
    # contexts spread over [context / 2, context], as streams that started at different times
    seq_lens = [context - (context // 2) * i // max(streams - 1, 1) for i in range(streams)]
    slots = torch.tensor(
        [t[(n - 1) // size] * size + (n - 1) % size for t, n in zip(tables, seq_lens, strict=True)]
    )
    attention = Attention(heads, dim, kv_heads, 0, dim**-0.5)
    ops = attention_ops()
    assert ops is not None  # main() checked
    kernel_inputs = (
        q.view(streams, heads, dim),
        cache,
        torch.tensor(tables),
        torch.zeros(streams, dtype=torch.long),
        torch.tensor(seq_lens),
        dim**-0.5,
        0.0,
    )

    def kernel() -> None:  # the step's attention kernel calls alone
        for _ in range(layers):
            ops.paged_attention(*kernel_inputs)

    def step() -> torch.Tensor:  # one step: the plan once, then every layer's attention
        metadata = AttentionMetadata(
            list(range(streams + 1)),
            seq_lens,
            causal=True,
            slot_mapping=slots,
            block_tables=tables,
            block_size=size,
            kv_caches=[cache],
        )
        with forward_context(metadata):
            for _ in range(layers):
                out = attention(q, k, v)
        return out

    kernel_ms = median_ms(kernel, min_run_time)
    new_ms = median_ms(step, min_run_time)
    new = step()
    with use_torch():
        old_ms = median_ms(step, min_run_time)
        old = step()
    diff = float((old.float() - new.float()).abs().max())
    name = str(dtype).removeprefix("torch.")
    return [name, streams, context, old_ms, new_ms, old_ms / new_ms, kernel_ms, diff]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="JSONL with a 'text' field per line")
    parser.add_argument("--num-texts", type=int, default=500, help="without --data")
    parser.add_argument("--parts", default="encoder,decode", help="which benchmarks to run")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--min-run-time", type=float, default=2.0, help="seconds per timing")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    print(f"{cpu_banner()}\ntorch {torch.__version__}, threads {args.threads}")
    if attention_ops() is None:
        raise SystemExit("the attention kernels did not build; see the log line above")

    parts = args.parts.split(",")
    if "encoder" in parts:
        lengths = chunk_lengths(args.data, args.num_texts)
        rows = []
        for dtype in dtypes:
            *row, diff = bench_encoder(lengths, dtype, args.min_run_time)
            rows.append([*row, row[-2] / row[-1], diff])
        print_table(
            f"encoder: MiniLM attention x {ENCODER['layers']} layers over the embed steps "
            f"({ENCODER['budget']}-token budget); ms per pass over the corpus (median)",
            ["dtype", "chunks", "tokens", "steps", "old calls", "new calls", "old ms", "new ms"]
            + ["ratio", "max diff"],
            rows,
        )
    if "decode" in parts:
        rows = [
            bench_decode(streams, context, dtype, args.min_run_time)
            for dtype in dtypes
            for streams in map(int, args.streams.split(","))
            for context in map(int, args.contexts.split(","))
        ]
        print_table(
            f"decode: SmolLM2 attention x {DECODER['layers']} layers, one step (KV write + plan "
            "+ attention); old = gather of padded block tables, new = kernel; kernel = the "
            "kernel's calls alone; ms per step (median); contexts spread over [context / 2, "
            "context]",
            ["dtype", "streams", "context", "old ms", "new ms", "ratio", "kernel ms", "max diff"],
            rows,
        )


if __name__ == "__main__":
    main()
