"""cenote on a CUDA GPU, one table: the environment, MiniLM embeddings against
sentence-transformers (fp32 reference, same GPU), greedy decode of a tiny random-weight Llama
against transformers, CUDA-graph decode against eager (bit-identical), embedding throughput
against sentence-transformers and decode throughput against transformers ``generate`` (1 / 16 /
64 streams, cenote with and without CUDA graphs) on the same GPU.

Run by scripts/gpu_check.sh (which also runs the parity tests with CENOTE_TEST_DEVICE=cuda);
exits 1 when a check misses its target. ``--out FILE`` also writes the table there.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F

COSINE_TARGET = 0.9999  # fp32 vs sentence-transformers fp32 (DESIGN.md)
BF16_COSINE_TARGET = 0.999  # the default dtype on the GPU
NUM_TEXTS = 8192
ST_BATCH_SIZES = (64, 256, 1024)

rows: list[tuple[str, str, str]] = []  # (check, result, verdict)
failed: list[str] = []


def record(check: str, result: str, ok: bool | None = None) -> None:
    verdict = "" if ok is None else ("ok" if ok else "FAIL")
    rows.append((check, result, verdict))
    if ok is False:
        failed.append(check)
    print(f"{check}: {result} {verdict}", flush=True)


def probe() -> None:
    import triton

    from cenote.models.layers.torch_varlen import varlen_available

    props = torch.cuda.get_device_properties(0)
    record("GPU", f"{props.name}, {props.total_memory >> 30} GiB, cc {props.major}.{props.minor}")
    record(
        "torch / CUDA / Triton",
        f"{torch.__version__} / {torch.version.cuda} / {triton.__version__}",
    )
    record("torch varlen_attn", "available" if varlen_available() else "absent (SDPA per length)")


def corpus() -> list[str]:
    from tests.factories.texts import PARITY_TEXTS, PROSE

    words = " ".join(PROSE).split()
    generator = torch.Generator().manual_seed(0)
    texts = list(PARITY_TEXTS)
    while len(texts) < NUM_TEXTS:
        start = int(torch.randint(0, len(words) - 8, (1,), generator=generator))
        length = int(torch.randint(4, 120, (1,), generator=generator))
        texts.append(" ".join(words[start : start + length]))
    return texts


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def embeddings() -> None:
    from sentence_transformers import SentenceTransformer

    from cenote import LLM
    from cenote.config import default_model_path
    from tests.factories.texts import PARITY_TEXTS

    path = str(default_model_path())
    st = SentenceTransformer(path, device="cuda").float().eval()
    reference = st.encode(PARITY_TEXTS, batch_size=32, convert_to_tensor=True).float().cpu()
    for dtype, target in (("float32", COSINE_TARGET), ("auto", BF16_COSINE_TARGET)):
        llm = LLM(device="cuda", dtype=dtype)
        got = torch.tensor(
            [
                o.outputs.embedding
                for o in llm.embed(PARITY_TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
            ]
        )
        cosine = F.cosine_similarity(got, reference, dim=-1).min().item()
        name = str(llm.engine.config.model.dtype).removeprefix("torch.")
        record(
            f"MiniLM cosine vs ST fp32 ({name})",
            f"min {cosine:.6f} (>= {target})",
            cosine >= target,
        )
        if dtype == "auto":
            throughput(llm, st)
        del llm
        torch.cuda.empty_cache()


def throughput(llm, st) -> None:
    texts = corpus()
    llm.embed(texts[:512], truncate_prompt_tokens=-1, use_tqdm=False)  # warm-up
    ours = len(texts) / timed(lambda: llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False))
    st_rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        st.to(dtype)
        for batch in ST_BATCH_SIZES:
            st.encode(texts[:512], batch_size=batch)  # warm-up
            elapsed = timed(lambda b=batch: st.encode(texts, batch_size=b, convert_to_tensor=True))
            st_rates[(str(dtype).removeprefix("torch."), batch)] = len(texts) / elapsed
    (best_dtype, best_batch), best = max(st_rates.items(), key=lambda item: item[1])
    record(f"embed texts/s, {len(texts)} texts: cenote (bf16)", f"{ours:,.0f}")
    for (dtype, batch), rate in st_rates.items():
        record(f"embed texts/s: sentence-transformers {dtype} batch {batch}", f"{rate:,.0f}")
    record(
        "cenote / best sentence-transformers",
        f"{ours / best:.2f}x (ST best: {best_dtype}, batch {best_batch}; target 1.5x)",
    )


def greedy() -> None:
    from cenote import LLM, SamplingParams
    from tests.factories.decoders import make_decoder
    from tests.factories.generation import hf_greedy, random_prompts, token_prompts

    folder = Path(tempfile.mkdtemp())
    theirs = make_decoder(folder, "llama")
    prompts = random_prompts([1, 5, 9, 17, 30], seed=1)
    expected = hf_greedy(theirs, prompts, 24)
    llm = LLM(str(folder), device="cuda", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [
        llm.generate(token_prompts([p]), params, use_tqdm=False)[0].outputs[0].token_ids
        for p in prompts
    ]
    batched = [
        o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), params, use_tqdm=False)
    ]
    same = sum(a == e for a, e in zip(alone, expected, strict=True))
    same_batched = sum(b == e for b, e in zip(batched, expected, strict=True))
    record(
        "tiny Llama greedy vs transformers (fp32, paged KV)",
        f"{same}/{len(prompts)} alone, {same_batched}/{len(prompts)} batched token-identical",
        same == same_batched == len(prompts),
    )


def decode_graphs() -> None:
    """CUDA graphs against eager on the tiny Llama (fp32): a graph's replay equals the eager
    trunk over the same static inputs bit for bit; greedy tokens are identical to
    ``enforce_eager=True``; logprobs are bit-identical where the batch is a captured size
    (1, 4 streams), and only close where it is padded (5 streams run the size 8: the matmuls
    see 8 rows, not 5)."""
    from cenote import LLM, SamplingParams
    from tests.factories.decoders import make_decoder
    from tests.factories.generation import random_prompts, token_prompts

    folder = Path(tempfile.mkdtemp())
    make_decoder(folder, "llama")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(folder), device="cuda", dtype="float32", block_size=4, enforce_eager=eager)
        graphs = llm.engine.runner.decode_graphs
        assert (graphs is None) == eager
        for count in (1, 4, 5):
            prompts = token_prompts(random_prompts([3 + 4 * i for i in range(count)], seed=count))
            outputs = llm.generate(prompts, params, use_tqdm=False)
            runs[(eager, count)] = [
                (o.outputs[0].token_ids, [sorted(s.items()) for s in o.outputs[0].logprobs])
                for o in outputs
            ]
        if graphs is not None:
            record("decode graphs captured (tiny Llama)", f"sizes {sorted(graphs.graphs)}")
            size = 8  # the last step above: 5 streams, padded to 8
            replayed = graphs.graphs[size].replay().clone()
            with torch.inference_mode():
                recomputed = graphs.forward(size)
            record(
                "graph replay vs eager trunk, same inputs (size 8, fp32)",
                "bit-identical" if torch.equal(replayed, recomputed) else "differ",
                torch.equal(replayed, recomputed),
            )
        del llm
        torch.cuda.empty_cache()
    for count in (1, 4, 5):
        eager, graphed = runs[(True, count)], runs[(False, count)]
        same_tokens = all(e[0] == g[0] for e, g in zip(eager, graphed, strict=True))
        diff = max(
            abs(a[1].logprob - b[1].logprob)
            for e, g in zip(eager, graphed, strict=True)
            for step_e, step_g in zip(e[1], g[1], strict=True)
            for a, b in zip(step_e, step_g, strict=True)
        )
        exact = count in (1, 4)
        record(
            f"greedy with graphs vs enforce_eager, {count} streams (fp32)",
            f"tokens {'identical' if same_tokens else 'DIFFER'}, logprobs max |diff| {diff:.3g}"
            + (" (a captured size: must be 0)" if exact else " (padded to 8)"),
            same_tokens and (diff == 0 or not exact),
        )


DECODE_SHAPE = dict(  # SmolLM2-135M's shape; random weights, so nothing is carried to the GPU
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
)
DECODE_STREAMS = (1, 16, 64)
PROMPT_TOKENS, NEW_TOKENS = 32, 128
DECODE_TARGET = 2.0  # cenote / transformers generate at 16 streams


def record_kv_cache(llm, label: str) -> None:
    """The KV cache the engine sized from --gpu-memory-utilization (0.9 of the GPU, less its
    weights, one profiled step and the graphs; a second engine gets what the first left)."""
    from cenote.kv_cache.manager import kv_cache_bytes_per_block

    manager = llm.engine.kv_cache_manager
    model, cache = llm.engine.model, llm.engine.config.cache
    per_block = kv_cache_bytes_per_block(
        model.num_layers, model.num_kv_heads, model.head_dim, cache.block_size,
        llm.engine.config.model.dtype,
    )  # fmt: skip
    free, total = torch.cuda.mem_get_info()
    record(
        f"KV cache from gpu_memory_utilization {cache.gpu_memory_utilization}, {label}",
        f"{manager.num_blocks:,} blocks of {cache.block_size} tokens = "
        f"{manager.num_blocks * per_block / (1 << 30):.1f} GiB; GPU {free / (1 << 30):.1f} of "
        f"{total / (1 << 30):.1f} GiB free after start-up",
    )


def decode_throughput() -> None:
    """Tokens/s of greedy decode, bf16, ``NEW_TOKENS`` a stream after ``PROMPT_TOKENS``-token
    prompts: cenote (paged KV, the Triton decode kernel) against transformers ``generate``
    (its default dynamic cache), each warmed up once at every stream count."""
    from cenote import LLM, SamplingParams
    from tests.factories.decoders import make_decoder

    folder = Path(tempfile.mkdtemp())
    theirs = make_decoder(folder, "llama", **DECODE_SHAPE)
    theirs = theirs.to("cuda", torch.bfloat16).eval()
    engines = {}
    for name, eager in (("cenote", False), ("cenote eager", True)):
        start = time.perf_counter()
        engines[name] = LLM(str(folder), device="cuda", dtype="bfloat16", enforce_eager=eager)
        record(f"engine start-up, SmolLM2 shape ({name})", f"{time.perf_counter() - start:.1f} s")
        record_kv_cache(engines[name], f"SmolLM2 shape ({name})")
    gen = torch.Generator().manual_seed(0)
    for streams in DECODE_STREAMS:
        ids = torch.randint(3, DECODE_SHAPE["vocab_size"], (streams, PROMPT_TOKENS), generator=gen)
        prompts = [{"prompt_token_ids": row.tolist()} for row in ids]

        def run_engine(new: int, llm, prompts: list[dict] = prompts) -> None:
            params = SamplingParams(
                temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False
            )
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == new for o in outputs)

        def reference(new: int, ids: torch.Tensor = ids.cuda()) -> None:
            with torch.inference_mode():
                out = theirs.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
            assert out.shape[1] == PROMPT_TOKENS + new

        runs = {name: functools.partial(run_engine, llm=llm) for name, llm in engines.items()}
        runs["transformers"] = reference
        rates = {}
        for name, run in runs.items():
            run(8)  # warm-up
            rates[name] = streams * NEW_TOKENS / timed(lambda run=run: run(NEW_TOKENS))
        ratio = rates["cenote"] / rates["transformers"]
        at_target = streams == 16
        record(
            f"decode tok/s, {streams} streams x {NEW_TOKENS} (bf16, SmolLM2 shape): cenote",
            f"{rates['cenote']:,.0f} (CUDA graphs; eager {rates['cenote eager']:,.0f}: "
            f"{rates['cenote'] / rates['cenote eager']:.2f}x) vs transformers "
            f"{rates['transformers']:,.0f}: {ratio:.2f}x"
            + (f" (target {DECODE_TARGET}x)" if at_target else ""),
            ratio >= DECODE_TARGET if at_target else None,
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    for step in (probe, embeddings, greedy, decode_graphs, decode_throughput):
        try:
            step()
        except Exception as e:  # one broken check must not hide the others' results
            traceback.print_exc()
            record(step.__name__, f"raised {type(e).__name__}: {e}", False)
    table = ["| check | result | |", "| --- | --- | --- |"]
    table += [f"| {check} | {result} | {verdict} |" for check, result, verdict in rows]
    text = "\n".join(table) + "\n"
    print("\n" + text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
