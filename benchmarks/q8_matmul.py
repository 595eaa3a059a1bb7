"""The 8-bit-activation row kernel (``quant_matmul_q8``) against today's row kernels at
SmolLM2's projection shapes, 1/2/4/8 rows: the bf16 row kernel (bf16 rows, AVX512-BF16 dot
products) and the fp32 row kernel (fp32 rows, each weight widened to fp32), each against the q8
kernel on the same rows. Q4_1 (the GGUF's own bytes) and Q8_0 weights. Timings alternate
between the kernels, rep by rep, so a neighbour's load falls on both; medians in microseconds
for one layer's 4 projections (qkv, o, gate_up, down).

    flock /tmp/cpu_bench.lock python -m benchmarks.q8_matmul --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cenote.kernels import cpu_features, cpu_model, quant_ops
from cenote.models.layers.quant import QuantizedWeight, from_gguf

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2: qkv, o, gate_up, down


def _weight(n: int, k: int, qtype: str) -> QuantizedWeight:
    dense = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    weight = from_gguf(quantize(dense, GGMLQuantizationType[qtype]), qtype, (n, k))
    assert weight is not None
    return weight


def _layer(kernel: Callable[..., torch.Tensor], weights: list[QuantizedWeight], rows, dtype):
    inputs = [torch.randn(rows, w.shape[1]).to(dtype) for w in weights]

    def run() -> None:
        for x, w in zip(inputs, weights, strict=True):
            kernel(x, w.qdata, w.scales, w.mins, w.bits, w.group)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = quant_ops()
    assert ops is not None
    print(f"CPU: {cpu_model()} ({' '.join(cpu_features())}); {args.threads} threads")
    print(f"build: {' '.join(ops.compiled_isa())}")
    print("weights rows | today (kernel)     us | q8 us  | q8 / today")
    for qtype in ("Q4_1", "Q8_0"):
        weights = [_weight(n, k, qtype) for n, k in SHAPES]
        for rows in (1, 2, 4, 8):
            todays = [("fp32 row", torch.float32)]
            if ops.quant_dot_supported() and qtype == "Q4_1":
                todays.insert(0, ("bf16 row", torch.bfloat16))
            for name, dtype in todays:
                runs = {
                    "today": _layer(ops.quant_matmul, weights, rows, dtype),
                    "q8": _layer(ops.quant_matmul_q8, weights, rows, dtype),
                }
                times: dict[str, list[float]] = {key: [] for key in runs}
                for run in runs.values():
                    run()
                for _ in range(args.repeats):
                    for key, run in runs.items():
                        start = time.perf_counter()
                        run()
                        times[key].append(time.perf_counter() - start)
                today, q8 = (statistics.median(times[key]) * 1e6 for key in ("today", "q8"))
                print(f"{qtype}  {rows:4d} | {today:7.1f} ({name}) | {q8:6.1f} | {q8 / today:.2f}")


if __name__ == "__main__":
    main()
