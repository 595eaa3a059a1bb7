"""Fidelity of the 8-bit-activation row kernel on the real SmolLM2 Q4_1 GGUF: greedy tokens of
the test prompts (tests/kernels/test_quant.py's) with every projection of 1-8 rows on
``quant_matmul_q8``, against the dequantized fp32 model; at the first divergence, the fp32
model's logprob gap between its own token and the q8 run's. The decode stack is left out (it
calls the fp32 row kernel from C++), so the Python layer loop runs the same projections.

    flock /tmp/cpu_bench.lock python -m benchmarks.experiments.q8_fidelity [--max-tokens 32]
"""

from __future__ import annotations

import argparse

import torch

from cenote import LLM, SamplingParams
from cenote.kernels import cpu_model, quant_ops
from cenote.runner.decode_stack import DecodeStackStep
from tests.factories.smollm2 import find_smollm2_gguf

PROMPTS = ["Explain why the sky is blue.", "Write a haiku about the sea."]


def _route_rows_to_q8() -> None:
    ops = quant_ops()
    assert ops is not None
    row_kernel, q8 = ops.quant_matmul, ops.quant_matmul_q8

    def quant_matmul(x, q, scale, mn, bits, group):  # type: ignore[no-untyped-def]
        if x.shape[0] <= 8 and group == 32:
            return q8(x, q, scale, mn, bits, group)
        return row_kernel(x, q, scale, mn, bits, group)

    setattr(ops, "quant_matmul", quant_matmul)  # noqa: B010  (a pybind11 module's attribute)
    setattr(DecodeStackStep, "__call__", lambda self, *args: None)  # noqa: B010


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = str(find_smollm2_gguf())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=20)
    dense = LLM(path, dtype="float32", quantization="none").generate(PROMPTS, params)
    _route_rows_to_q8()
    q8 = LLM(path, dtype="float32", quantization="auto").generate(PROMPTS, params)
    print(f"CPU: {cpu_model()}; build: {' '.join(quant_ops().compiled_isa())}")
    for prompt, ref, got in zip(PROMPTS, dense, q8, strict=True):
        ref_ids, got_ids = ref.outputs[0].token_ids, got.outputs[0].token_ids
        if ref_ids == got_ids:
            print(f"{prompt!r}: {len(ref_ids)} tokens identical")
            continue
        i = next(i for i, (a, b) in enumerate(zip(ref_ids, got_ids, strict=False)) if a != b)
        top = ref.outputs[0].logprobs[i]
        gap = top[ref_ids[i]].logprob - top[got_ids[i]].logprob if got_ids[i] in top else None
        print(f"{prompt!r}: first divergence at token {i}; fp32 logprob gap {gap}")


if __name__ == "__main__":
    main()
