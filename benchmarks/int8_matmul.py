"""int8 x int8 GEMMs (w8a8) vs dense fp32/bf16 (oneDNN-prepacked) at the shapes of all-MiniLM-L6-v2.

Issue 10 item 7 asks whether int8 compute pays where FLOPs bind (embeddings). Prints the CPU, then
per (rows M, shape) the best time of:

- ``fp32`` / ``bf16``: the dense prepacked matmul + bias cenote runs today (``packed_linear``);
- ``int_mm`` / ``qlinear``: the int8 GEMM alone (``torch._int_mm``; oneDNN's
  ``onednn::qlinear_pointwise`` on a ``qlinear_prepack``-ed weight, int8 activations);
- ``quant``: per-token symmetric quantization of the bf16 activations, eager torch; ``quant c``
  the same compiled by inductor (``torch.compile``, one fused pass: the cheapest it gets
  without fusing it into the op before);
- ``w8a8 int_mm`` / ``w8a8 qlinear``: the whole layer from bf16 rows to bf16 rows with bias
  (quantize per token, int8 GEMM, per-channel x per-token rescale in fp32, bias), eager;
  ``w8a8 c``: the qlinear one with the quantization and the epilogue compiled;
- ``dynamic``: torch's dynamic quantized linear (``torch.ao`` ``quantize_dynamic``, engine
  onednn, the fastest of x86/fbgemm/onednn here): fp32 rows in and out (a bf16 model's casts
  to and from not counted), one per-tensor scale found and applied inside the op (torch
  deprecates these quantized tensors);
- ``w8a8 tensor``: one per-tensor activation scale, so oneDNN fuses rescale + bias + bf16 output
  (the cheapest eager int8 layer, at a fidelity cost);
- ``cenote``: cenote's own w8a8 layer (``quantization="w8a8"``, cenote/kernels/int8_linear.cpp):
  per-row asymmetric quantization fused into the tasks, brgemm int8 micro-kernels, the rescale
  and bias in the tile's epilogue, bf16 out (absent where the kernels cannot run).

The last column is bf16's time over the best full w8a8 layer's (>1: int8 wins).

    flock /tmp/cpu_bench.lock .venv/bin/python -m benchmarks.int8_matmul

Measured (Intel Xeon Processor with avx512_bf16, avx512_vnni, amx_bf16, amx_int8; 2 threads;
torch 2.13; microseconds, best of 5-30; selected columns of one run, others in the last row):

    shape             M    fp32   bf16  qlinear quant c  w8a8 c dynamic w8a8 tensor speed-up
    qkv 384->1152   256     512     72       66      37     291     119         158    0.60x
    qkv 384->1152  1024    2046    242      211      90     754     387         470    0.62x
    qkv 384->1152  4096    8539    887      958     362    2681    1636        2359    0.54x
    out 384->384    256     178     47       36      39     153      77         102    0.61x
    out 384->384   1024     671     82       67      86     381     228         337    0.36x
    out 384->384   4096    2657    306      294     358    1159     765        1625    0.40x
    up 384->1536    256     690     90       78      38     335     146         180    0.62x
    up 384->1536   1024    2744    327      293      89     925     468         524    0.70x
    up 384->1536   4096   11474   1259     1056     372    3444    1764        2336    0.71x
    down 1536->384  256     699    172       67      86     277     230         338    0.75x
    down 1536->384 1024    2805    445      214     350     799     737        1501    0.60x
    down 1536->384 4096   11271   1528      827    1511    2961    3129        7790    0.52x
    sum                   44285   5457     4168    3419   14159    9684       17720
    (sums of the rest: int_mm 6584, quant 14038, w8a8 int_mm 72730, w8a8 qlinear 32040)

Max abs error over max abs output vs the fp32 layer: bf16 3.8e-3, per-token w8a8 1.3e-2,
per-tensor 1.6e-2 (oneDNN) / 2.6e-2 (``dynamic``).

Verdict on this machine: no int8 layer beats the bf16 default; the best (``dynamic``, per-tensor)
runs at 0.56x of bf16 over all rows (0.61x in a second run; 0.36-0.75x per shape), the
per-token ones at 0.39x (compiled) or less. The bound is the int8 GEMM itself: AMX int8 is only
1.31x (second run 1.25x) the AMX bf16 GEMM at these sizes (0.9x for qkv at 4096 rows, 1.85x for
down at 4096), and quantizing the activations in one fused pass (``quant c``) already costs 63 %
of the bf16 GEMM, before the rescale. Against fp32 the picture flips (``dynamic`` 4.6x faster
than fp32 dense), which matters only where fp32 is the default (AVX2-only CPUs such as the
project's AMD Zen 3: no AMX, no VNNI; not measured).
"""

from __future__ import annotations

import argparse
import timeit
import warnings
from collections.abc import Callable

import torch

from cenote.kernels import quant_ops
from cenote.models.layers.linear import pack_weight, packed_linear

SHAPES = {  # name -> (N out, K in): MiniLM's layers (hidden 384, intermediate 1536)
    "qkv 384->1152": (1152, 384),
    "out 384->384": (384, 384),
    "up 384->1536": (1536, 384),
    "down 1536->384": (384, 1536),
}
W8A8 = ("w8a8 int_mm", "w8a8 qlinear", "w8a8 c", "dynamic", "w8a8 tensor", "cenote")  # full layers
FLAGS = ("avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")


def cpu_identity() -> tuple[str, list[str]]:
    """The CPU's model name and which of ``FLAGS`` it has."""
    name, flags = "unknown", set()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name") and name == "unknown":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    return name, [flag for flag in FLAGS if flag in flags]


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Microseconds of one call: the best of ``repeats`` (a busy shared machine only adds)."""
    fn()  # warm-up: first-call allocations, compilation
    return min(timeit.repeat(fn, number=1, repeat=repeats)) * 1e6


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``[M, K]`` and fp32 scales ``[M, 1]``: symmetric, one scale per row."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


@torch.compile(dynamic=True)
def quantize_rows_compiled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows(x)


@torch.compile(dynamic=True)
def rescale_compiled(acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(bias, acc, scale).bfloat16()


def candidates(m: int, n: int, k: int) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    """Each way to run the layer on ``m`` rows, and each full w8a8 layer's max abs error
    against the fp32 layer (relative to the output's max abs)."""
    x = torch.randn(m, k)
    weight, bias = torch.randn(n, k) * 0.05, torch.randn(n) * 0.1
    x16, weight16, bias16 = x.bfloat16(), weight.bfloat16(), bias.bfloat16()
    packed32, packed16 = pack_weight(weight), pack_weight(weight16)
    w_scale = weight.abs().amax(-1) / 127  # [n]
    wq = torch.round(weight / w_scale[:, None]).clamp(-127, 127).to(torch.int8)  # [n, k]
    wq_t = wq.t()  # [k, n] view: _int_mm's layout (measured: no slower than a contiguous copy)
    w_packed = torch.ops.onednn.qlinear_prepack(wq, [m, k])
    w_zero = torch.zeros(n, dtype=torch.int64)
    x16_as_fp32 = x16.float()  # the same rows for the fp32-only op (its casts are not counted)
    xq, x_scale = quantize_rows(x16)

    def qlinear(
        q: torch.Tensor, scale: float, b: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(
            q, scale, 0, w_packed, w_scale, w_zero, b, 1.0, 0, dtype, "none", [], ""
        )

    def w8a8_int_mm() -> torch.Tensor:
        q, s = quantize_rows(x16)
        acc = torch._int_mm(q, wq_t)  # int32 [m, n]
        return torch.addcmul(bias, acc.float(), s * w_scale).bfloat16()

    def w8a8_qlinear() -> torch.Tensor:
        q, s = quantize_rows(x16)
        return torch.addcmul(bias, qlinear(q, 1.0, None, torch.float32), s).bfloat16()

    def w8a8_compiled() -> torch.Tensor:
        q, s = quantize_rows_compiled(x16)
        return rescale_compiled(qlinear(q, 1.0, None, torch.float32), s, bias)

    def w8a8_tensor() -> torch.Tensor:
        xf = x16.float()
        scale = float(xf.abs().amax()) / 127
        q = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
        return qlinear(q, scale, bias, torch.bfloat16)

    dense = torch.nn.Linear(k, n)
    dense.weight.data, dense.bias.data = weight, bias
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation of quantized tensors
        # (the root module is never swapped: wrap it)
        dynamic = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(dense), {torch.nn.Linear}, torch.qint8
        )

    layers: dict[str, Callable[[], torch.Tensor]] = {  # bf16 and the full int8 layers
        "bf16": lambda: packed_linear(x16, weight16, packed16, bias16),
        "w8a8 int_mm": w8a8_int_mm,
        "w8a8 qlinear": w8a8_qlinear,
        "w8a8 c": w8a8_compiled,
        "dynamic": lambda: dynamic(x16_as_fp32),
        "w8a8 tensor": w8a8_tensor,
    }
    ops = quant_ops()
    if ops is not None and ops.int8_supported():
        int8_weight = ops.int8_pack(weight)
        layers["cenote"] = lambda: ops.int8_linear(x16, *int8_weight, bias16, None, False)
    fns: dict[str, Callable[[], object]] = {
        "fp32": lambda: packed_linear(x, weight, packed32, bias),
        "bf16": layers["bf16"],
        "int_mm": lambda: torch._int_mm(xq, wq_t),
        "qlinear": lambda: qlinear(xq, 1.0, None, torch.float32),
        "quant": lambda: quantize_rows(x16),
        "quant c": lambda: quantize_rows_compiled(x16),
        **{c: layers[c] for c in W8A8 if c in layers},
    }
    reference = torch.nn.functional.linear(x16_as_fp32, weight, bias)
    span = float(reference.abs().max())
    errors = {c: float((fn().float() - reference).abs().max()) / span for c, fn in layers.items()}
    return fns, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.quantized.engine = "onednn"
    name, flags = cpu_identity()
    print(
        f"CPU: {name}; flags: {' '.join(flags)}; threads {args.threads}; torch {torch.__version__}"
    )
    names = list(candidates(8, 64, 64)[0])
    print(f"{'shape':<18}{'M':>5}" + "".join(f"{c:>13}" for c in names) + "  speed-up")
    totals = {c: 0.0 for c in names}
    worst: dict[str, float] = {}
    for shape, (n, k) in SHAPES.items():
        for m in args.rows:
            fns, errors = candidates(m, n, k)
            repeats = max(5, args.repeats // (1 + (m * n * k) // 200_000_000))
            row = {c: best_time(fn, repeats) for c, fn in fns.items()}
            for c in names:
                totals[c] += row[c]
            for c, e in errors.items():
                worst[c] = max(worst.get(c, 0.0), e)
            best = min(row[c] for c in W8A8 if c in row)
            print(
                f"{shape:<18}{m:>5}"
                + "".join(f"{row[c]:>13.0f}" for c in names)
                + f"  {row['bf16'] / best:>8.2f}x"
            )
    print(f"{'sum of all rows':<23}" + "".join(f"{totals[c]:>13.0f}" for c in names))
    best_total = min(totals[c] for c in W8A8 if c in totals)
    print(
        f"bf16 / best w8a8 layer: {totals['bf16'] / best_total:.2f}x; bf16 / int8 GEMM alone "
        f"(no quantization, no rescale: the bound): {totals['bf16'] / totals['qlinear']:.2f}x"
    )
    print("max abs error / max abs output vs the fp32 layer (bf16 rows in):")
    print("  " + ", ".join(f"{c}: {e:.2e}" for c, e in worst.items()))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
