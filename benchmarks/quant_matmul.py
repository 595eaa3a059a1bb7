"""Weight-only quantized matmul vs dense fp32/bf16 (oneDNN-prepacked) at the shapes of SmolLM2.

Prints the CPU, then per (rows M, shape) the median time of: the fused kernel (w4 = the GGUF's
Q4_1 layout, w8 = Q8_0), dequantize + matmul, and the dense prepacked matmul in fp32 and bf16 —
the numbers that choose ``FUSED_MAX_ROWS`` in cenote/models/layers/quant.py. ``--fused-only``
times the two fused kernels alone (the fp32 row kernel's own comparisons: run it under two
builds, alternating, as docs/performance.md records).

    flock /tmp/cpu_bench.lock python -m benchmarks.quant_matmul
    flock /tmp/cpu_bench.lock python -m benchmarks.quant_matmul --fused-only --rows 1 2 3 4 5 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cenote.kernels import cpu_features, cpu_model, quant_ops
from cenote.models.layers.linear import pack_weight, packed_linear
from cenote.models.layers.quant import quantize_dense

SHAPES = {  # name -> (N out, K in)
    "qkv 576->960": (960, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}


def timeit(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def candidates(m, k, dense, packed32, packed16, w4, w8):
    """The five ways to multiply ``m`` rows, as argument-free callables."""
    ops = quant_ops()
    x = torch.randn(m, k)
    x16, dense16 = x.bfloat16(), dense.bfloat16()
    return [
        lambda: ops.quant_matmul(x, w4.qdata, w4.scales, w4.mins, 4, 32),
        lambda: ops.quant_matmul(x, w8.qdata, w8.scales, None, 8, 32),
        lambda: torch.mm(x16, w4.dequantize(torch.bfloat16, workspace=True).t()),
        lambda: packed_linear(x, dense, packed32, None),
        lambda: packed_linear(x16, dense16, packed16, None),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16, 32, 128])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--fused-only", action="store_true", help="time the fused kernels only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = quant_ops()
    assert ops is not None, "kernel unavailable"
    print(f"CPU: {cpu_model()}; features: {' '.join(cpu_features())}; threads {args.threads}")
    print(f"build: {' '.join(ops.compiled_isa())}")
    print(
        f"{'shape':<20}{'M':>5}{'w4 fused':>10}{'w8 fused':>10}{'w4 deq+mm':>11}"
        f"{'fp32':>9}{'bf16':>9}   (microseconds, median)"
    )
    for name, (n, k) in SHAPES.items():
        dense = torch.randn(n, k) * 0.05
        w4, w8 = quantize_dense(dense, "int4"), quantize_dense(dense, "int8")
        packed32 = pack_weight(dense)
        packed16 = pack_weight(dense.bfloat16())
        for m in args.rows:
            repeats = max(3, args.repeats // (1 + (n * m) // 200_000))
            calls = candidates(m, k, dense, packed32, packed16, w4, w8)
            row = [timeit(fn, repeats) for fn in calls[: 2 if args.fused_only else None]]
            print(f"{name:<20}{m:>5}" + "".join(f"{v:>10.0f}" for v in row))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
