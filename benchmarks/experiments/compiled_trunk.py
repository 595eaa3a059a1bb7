"""Does ``torch.compile`` (inductor, CPU) make the encoder trunk faster? all-MiniLM-L6-v2's trunk
over the flat steps the engine runs on a corpus, eager (as cenote runs it) against compiled.

Prints the CPU model and flags, then per variant the median ms per corpus pass (every recorded
step once) over ``--passes`` passes after a warm-up, its ratio to eager, the first compiled
step's wall time (compile included), inductor's FX-graph cache hits / misses, and the max |diff|
and min row cosine of its hidden states against eager's (padding rows left out).

The steps are recorded from the engine itself: ``LLM.embed`` over the first ``--num-texts``
texts of ``--corpus`` (truncated to the model's 256 tokens), with the runner's model wrapped to
keep each step's input ids, positions and attention metadata (padded rows included, as
``runner/batch.py`` pads encoder steps). Variants:

- ``eager``: ``BertModel`` as the runner calls it, under ``forward_context`` (oneDNN-prepacked
  linears with fused GELU / residual epilogues, the C++ ``varlen_attention``).
- ``real``: ``torch.compile(dynamic=True)`` of a copy of that model with unpacked linears
  (plain ``F.linear``, so inductor's freezing can prepack them itself), driven exactly as eager.
  The step's offsets reach attention as Python lists through the forward context, so dynamo
  specializes on them.
- ``flat``: the same layers written out over tensors, the copy's weights with plain
  ``F.linear``, attention an opaque ``torch.library.custom_op`` (defined here) that takes the
  requests' starts / lengths as int64 tensors and calls ``cenote::varlen_attention``;
  compiled with ``dynamic=True`` and ``freezing``.
- ``flat-nofreeze``: ``flat`` without freezing (inductor then cannot prepack the weights).
- ``flat-autotune``: ``flat`` with ``mode="max-autotune-no-cudagraphs"`` (CPU GEMM templates).

Run it twice: the first run with ``--fresh-cache`` compiles cold, the second reads the FX-graph
cache under ``TORCHINDUCTOR_CACHE_DIR`` (default /tmp/cenote_compile_cache).

    flock /tmp/cpu_bench.lock .venv/bin/python -m benchmarks.experiments.compiled_trunk --fresh-cache
    flock /tmp/cpu_bench.lock .venv/bin/python -m benchmarks.experiments.compiled_trunk --dtype float32

Measured 2026-12-01, Intel Xeon 2 cores (AVX-512, AVX512-bf16, AMX), torch 2.13: 500 texts =
8 steps, 61,778 tokens (62,208 rows); ms per pass, median of 5, each run against its own eager.
bf16: eager 1057-1127; flat 1105 cold-cache run (0.96x), 1030 warm (1.04x): equal within the
runs' +-5% noise; flat-autotune 1050 (1.07x; every GEMM chose oneDNN ``_linear_pointwise`` with
GELU / add epilogues, as eager runs them, over the CPP GEMM template); flat-nofreeze 1259-1403
(0.76-0.84x); real 1144 (0.92x: 36 graphs, 21 graph breaks, a recompile per step's offsets,
12.4 s in its first pass). fp32: eager 5251, flat 5110 (1.03x), flat-nofreeze 5517 (0.95x).
First compiled step (compile included): flat 13.7 s cold, 7.0 s warm (the FX-graph cache is
bypassed, "mkldnn tensors unpickleable": freezing's packed weights; only inductor's C++ builds
are cached); flat-nofreeze 5.2 s cold, 2.1 s warm (FX cache hit); flat-autotune 19.7 s.
Fidelity: compiled vs eager bf16 max |diff| 7.8e-2, min row cosine 0.99922; against fp32
eager the compiled bf16 trunk (0.99958) is closer than eager bf16 (0.99794-0.99803; likely as
inductor keeps the add + LayerNorm in fp32); fp32 compiled vs eager max |diff| 8.6e-6.
Why so little: a profiled eager bf16 pass is 59% oneDNN matmuls and 31% varlen attention,
which compile leaves as they are; the LayerNorms, adds and embeddings it can fuse are 9%
(101 ms), and fused they took 91 ms.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/cenote_compile_cache")

import torch
import torch.nn.functional as F

from cenote import LLM
from cenote.config import default_model_path
from cenote.forward_context import AttentionMetadata, forward_context, get_attention_metadata
from cenote.kernels import cpu_features, cpu_model
from cenote.models.bert import BertLayer, BertModel
from cenote.models.layers.linear import TrunkLinear


@dataclass
class Step:
    """One engine step's trunk inputs, as the runner passed them."""

    input_ids: torch.Tensor  # [padded_rows] int64
    positions: torch.Tensor  # [padded_rows] int64
    attention: AttentionMetadata  # encoder: offsets of the requests, no KV cache
    starts: torch.Tensor  # [num_requests] int64, first row of each request
    lengths: torch.Tensor  # [num_requests] int64

    @property
    def num_tokens(self) -> int:
        """Rows that belong to requests (the rest are padding)."""
        return self.attention.query_start_loc[-1]


class _StepRecorder:
    """Stands in for the runner's model: keeps each step's inputs, then runs the model."""

    def __init__(self, model: BertModel) -> None:
        self.model = model
        self.steps: list[Step] = []

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        assert token_type_ids is None  # single-segment embedding prompts
        metadata = get_attention_metadata()
        self.steps.append(
            Step(
                input_ids,
                positions,
                metadata,
                torch.tensor(metadata.query_start_loc[:-1], dtype=torch.long),
                torch.tensor(metadata.query_lens, dtype=torch.long),
            )
        )
        return self.model(input_ids, positions, token_type_ids)


def record_steps(llm: LLM, texts: list[str]) -> list[Step]:
    runner = llm.engine.runner
    recorder = _StepRecorder(runner.model)  # type: ignore[arg-type]
    runner.model = recorder  # type: ignore[assignment]
    try:
        llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    finally:
        runner.model = recorder.model
    return recorder.steps


@torch.library.custom_op("cenote_bench::flat_attention", mutates_args=())
def flat_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,
    v: torch.Tensor,
    starts: torch.Tensor,  # [num_requests] int64
    lengths: torch.Tensor,  # [num_requests] int64
    scale: float,
) -> torch.Tensor:
    """Bidirectional attention of each request over its own rows; padding rows are zero."""
    out = torch.empty_like(q)
    starts_list, lengths_list = starts.tolist(), lengths.tolist()
    out[starts_list[-1] + lengths_list[-1] :].zero_()
    torch.ops.cenote.varlen_attention(q, k, v, out, starts_list, lengths_list, scale, False)
    return out


@flat_attention.register_fake
def _(q, k, v, starts, lengths, scale):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)


class FlatTrunk(torch.nn.Module):
    """``BertModel``'s forward (MiniLM: no token types, no mask) over tensors only, in torch ops
    dynamo can trace, with no forward context: the requests' offsets are inputs."""

    def __init__(self, model: BertModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        embeddings = self.model.embeddings
        x = embeddings.word_embeddings(input_ids) + embeddings.position_embeddings(positions)
        x = _layer_norm(embeddings.LayerNorm, x + embeddings.token_type_embeddings.weight[0])
        for layer in self.model.layers:
            x = _flat_layer(layer, x, starts, lengths)
        return x  # [num_tokens, hidden_size]


def _flat_layer(
    layer: BertLayer, x: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """``BertLayer.forward`` with plain linears, ``F.layer_norm`` and the attention custom op."""
    heads, dim = layer.attn.num_heads, layer.head_dim
    qkv = F.linear(x, layer.qkv.weight, layer.qkv.bias)
    q, k, v = (t.view(-1, heads, dim) for t in qkv.chunk(3, dim=-1))
    attended = flat_attention(q, k, v, starts, lengths, layer.attn.scale).view(-1, heads * dim)
    x = _layer_norm(
        layer.attn_norm, x + F.linear(attended, layer.attn_out.weight, layer.attn_out.bias)
    )
    inner = F.linear(x, layer.intermediate.weight, layer.intermediate.bias)
    assert layer.gelu_approximate is not None  # MiniLM: GELU
    inner = F.gelu(inner, approximate=layer.gelu_approximate)
    return _layer_norm(
        layer.output_norm, x + F.linear(inner, layer.output.weight, layer.output.bias)
    )


def _layer_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


def unpacked_copy(model: BertModel) -> BertModel:
    """A copy of ``model`` whose ``TrunkLinear``s run plain ``F.linear`` (no oneDNN packing)."""
    linears = [m for m in model.modules() if isinstance(m, TrunkLinear)]
    packed = [m._packed for m in linears]
    for m in linears:
        m._packed = None
    try:
        return copy.deepcopy(model)
    finally:
        for m, p in zip(linears, packed, strict=True):
            m._packed = p


RunStep = Callable[[Step], torch.Tensor]


def eager_runner(model: BertModel) -> RunStep:
    def run(step: Step) -> torch.Tensor:
        with forward_context(step.attention):
            return model(step.input_ids, step.positions, None)

    return run


def flat_runner(compiled: Callable[..., torch.Tensor]) -> RunStep:
    def run(step: Step) -> torch.Tensor:
        return compiled(step.input_ids, step.positions, step.starts, step.lengths)

    return run


def time_passes(run: RunStep, steps: list[Step], passes: int) -> list[float]:
    """ms of each of ``passes`` passes over every step."""
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for step in steps:
            run(step)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def compare(run: RunStep, reference: list[torch.Tensor], steps: list[Step]) -> tuple[float, float]:
    """Max |diff| and min row cosine against ``reference`` (fp32, requests' rows only)."""
    max_diff, min_cos = 0.0, 1.0
    for step, ref in zip(steps, reference, strict=True):
        out = run(step)[: step.num_tokens].float()
        max_diff = max(max_diff, (out - ref).abs().max().item())
        min_cos = min(min_cos, F.cosine_similarity(out, ref, dim=-1).min().item())
    return max_diff, min_cos


class _BypassReasons(logging.Handler):
    """Collects why inductor's FX-graph cache was bypassed (it logs the reason at INFO)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Bypassing FX Graph Cache" in message:
            self.reasons.add(message.split("because", 1)[-1].strip(" '"))


def compile_stats(bypass: _BypassReasons) -> str:
    """FX-graph cache hits / misses / bypasses (with reasons), graphs and graph breaks."""
    counters = torch._dynamo.utils.counters
    inductor = counters["inductor"]
    cache = "/".join(str(inductor[f"fxgraph_cache_{k}"]) for k in ("hit", "miss", "bypass"))
    breaks = sum(counters["graph_break"].values())
    text = f"fx cache hit/miss/bypass {cache}; graphs {counters['stats']['unique_graphs']}"
    text += f", graph breaks {breaks}"
    if breaks:
        reason = max(counters["graph_break"], key=counters["graph_break"].__getitem__)
        text += f" (most: {reason.splitlines()[0][:160]})"
    if bypass.reasons:
        text += f"; bypass: {'; '.join(sorted(bypass.reasons))}"
    return text


def load_texts(path: Path, num_texts: int) -> list[str]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(num_texts), f, strict=False)]


# variant -> (drive the real forward under its context?, inductor freezing, torch.compile mode)
VARIANTS: dict[str, tuple[bool, bool, str | None]] = {
    "real": (True, True, None),
    "flat": (False, True, None),
    "flat-nofreeze": (False, False, None),
    "flat-autotune": (False, True, "max-autotune-no-cudagraphs"),
}


def compiled_runner(variant: str, model: BertModel) -> RunStep:
    """A fresh compile of an unpacked copy of ``model`` (dynamic token and request counts)."""
    real, freezing, mode = VARIANTS[variant]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch._inductor.config.freezing = freezing
    copy_model = unpacked_copy(model)
    if real:
        return eager_runner(torch.compile(copy_model, dynamic=True, mode=mode))  # type: ignore[arg-type]
    return flat_runner(torch.compile(FlatTrunk(copy_model), dynamic=True, mode=mode))


def measure(
    variant: str,
    model: BertModel,
    steps: list[Step],
    references: list[list[torch.Tensor]],
    passes: int,
    eager_ms: float,
    bypass: _BypassReasons,
) -> str:
    """One result line: ms/pass, speed-up over eager, compile, fidelity, compile stats."""
    bypass.reasons.clear()
    run = compiled_runner(variant, model)
    start = time.perf_counter()
    run(steps[0])
    first_step = time.perf_counter() - start
    warm_up = time_passes(run, steps, 1)[0] / 1e3  # the other steps' shapes: guards, recompiles
    ms = statistics.median(time_passes(run, steps, passes))
    fidelity = [compare(run, reference, steps) for reference in references]
    columns = f"{variant:<14}{ms:>10.1f}{eager_ms / ms:>8.2f}x{first_step:>11.1f}{warm_up:>9.1f}"
    for diff, cos in fidelity:
        columns += f"{diff:>11.2e}{cos:>10.6f}"
    return f"{columns}\n{'':<14}{compile_stats(bypass)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--corpus", type=Path, default=Path("/root/peers/data/sentences.jsonl"))
    parser.add_argument("--num-texts", type=int, default=500)
    parser.add_argument("--max-step-tokens", type=int, default=8192)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=["real", "flat"], choices=list(VARIANTS))
    parser.add_argument("--fresh-cache", action="store_true", help="empty the inductor cache")
    args = parser.parse_args()
    cache_dir = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    if args.fresh_cache:
        shutil.rmtree(cache_dir, ignore_errors=True)
    bypass = _BypassReasons()
    codecache_log = logging.getLogger("torch._inductor.codecache")
    codecache_log.setLevel(logging.INFO)
    codecache_log.addHandler(bypass)
    codecache_log.propagate = False  # only the reasons, not every cache line on stderr
    print(f"CPU: {cpu_model()}; features: {' '.join(cpu_features())}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cache {cache_dir}")

    # 1) the engine's steps over the corpus
    path = str(default_model_path())
    llm = LLM(path, dtype=args.dtype, max_num_batched_tokens=args.max_step_tokens)
    steps = record_steps(llm, load_texts(args.corpus, args.num_texts))
    model: BertModel = llm.engine.runner.model  # type: ignore[assignment]
    num_tokens = sum(s.num_tokens for s in steps)
    num_rows = sum(s.input_ids.numel() for s in steps)
    print(
        f"all-MiniLM-L6-v2 {args.dtype}: {args.num_texts} texts, {len(steps)} steps, "
        f"{num_tokens} tokens ({num_rows} rows padded)"
    )

    with torch.inference_mode():
        # 2) references: eager in this dtype (and eager fp32 when this is bf16)
        eager = eager_runner(model)
        references = [[eager(s)[: s.num_tokens].float() for s in steps]]
        header = f"{'vs eager':>21}"
        if args.dtype != "float32":
            fp32 = LLM(path, dtype="float32", max_num_batched_tokens=args.max_step_tokens)
            fp32_eager = eager_runner(fp32.engine.runner.model)  # type: ignore[arg-type]
            references.append([fp32_eager(s)[: s.num_tokens].float() for s in steps])
            header += f"{'vs fp32 eager':>21}"
            del fp32, fp32_eager

        # 3) eager timing, then each compiled variant
        eager_ms = statistics.median(time_passes(eager, steps, args.passes))
        print(f"{'':<53}{header}")
        print(f"{'variant':<14}{'ms/pass':>10}{'speed-up':>9}{'1st step s':>11}{'pass 1 s':>9}"
              + f"{'max|diff|':>11}{'min cos':>10}" * len(references))  # fmt: skip
        eager_columns = f"{'eager':<14}{eager_ms:>10.1f}{1.0:>8.2f}x{'':>20}"
        if len(references) > 1:
            diff, cos = compare(eager, references[1], steps)
            eager_columns += f"{'':>21}{diff:>11.2e}{cos:>10.6f}"
        print(eager_columns)
        for variant in args.variants:
            try:
                print(measure(variant, model, steps, references, args.passes, eager_ms, bypass))
            except Exception as e:  # noqa: BLE001  (a variant that fails is a result)
                traceback.print_exc()
                print(f"{variant:<14}failed: {type(e).__name__}: {str(e)[:400]}")


if __name__ == "__main__":
    main()
