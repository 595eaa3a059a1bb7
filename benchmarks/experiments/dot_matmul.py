"""bf16 dot products on 4-bit (or 8-bit) weights (``quant_matmul_dot``) against a dense bf16 copy
(oneDNN-prepacked) and dequantize + matmul, for SmolLM2's four projections per layer.

Each path multiplies the same bf16 rows by 30 different weights of each shape in turn (as a
decode step does: the weights come from memory, not cache) and the time per layer is the sum of
the four shapes' minimum over ``--repeats``. These are the numbers behind ``DOT_MAX_ROWS`` and
``DOT_MAX_ROWS_WITH_COPY`` in cenote/models/layers/quant.py.

    flock /tmp/cpu_bench.lock python -m benchmarks.experiments.dot_matmul

Measured 2026-12-02, AMD EPYC Zen 4 2 cores (AVX512-bf16, no AMX), us a layer (dot / dense
bf16 copy / dequantize + matmul): 16 rows 580 / 725 / 1029, 32 rows 937 / 1096 / 1448, 64 rows
1598 / 1499 / 1985, 128 rows 2462 / 2489 / 2841, 192 rows 4021 / 3764 / 4178.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import best_seconds, cpu_banner
from cenote.kernels import quant_ops
from cenote.models.layers.linear import pack_weight, packed_linear
from cenote.models.layers.quant import quantize_dense

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--bits", type=int, choices=[4, 8], default=4, help="Q4_1- or Q8_0-like")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_banner(args.threads))
    ops = quant_ops()
    if ops is None or not ops.quant_dot_supported():
        sys.exit("quant_matmul_dot does not run here (it needs AVX512-BF16)")
    weights = {
        name: [quantize_dense(torch.randn(n, k), f"int{args.bits}") for _ in range(LAYERS)]
        for name, (n, k) in SHAPES.items()
    }
    dense = {name: [w.dequantize(torch.bfloat16) for w in ws] for name, ws in weights.items()}
    packed = {name: [pack_weight(d) for d in ds] for name, ds in dense.items()}
    print(f"{'rows':>5}{'dot':>10}{'copy':>10}{'dequant':>10}   (us a layer, 4 projections)")
    for rows in args.rows:
        total = {"dot": 0.0, "copy": 0.0, "dequant": 0.0}
        for name, (_, k) in SHAPES.items():
            x = torch.randn(rows, k).bfloat16()
            paths = {
                "dot": lambda x=x, ws=weights[name]: [
                    ops.quant_matmul_dot(x, w.qdata, w.scales, w.mins, w.bits, w.group) for w in ws
                ],
                "copy": lambda x=x, ds=dense[name], ps=packed[name]: [
                    packed_linear(x, d, p, None) for d, p in zip(ds, ps, strict=True)
                ],
                "dequant": lambda x=x, ws=weights[name]: [
                    torch.mm(x, w.dequantize(torch.bfloat16, workspace=True).t()) for w in ws
                ],
            }
            for path, run in paths.items():
                total[path] += best_seconds(run, args.repeats) / LAYERS
        print(
            f"{rows:>5}{total['dot'] * 1e6:>10.0f}{total['copy'] * 1e6:>10.0f}"
            f"{total['dequant'] * 1e6:>10.0f}"
        )


if __name__ == "__main__":
    main()
