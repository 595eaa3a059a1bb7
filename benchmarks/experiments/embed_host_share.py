"""What an offline embedding pass costs besides the model: ``LLM.embed`` of benchmarks/
gpu_check.py's 8,192 short texts (the parity corpus plus prose slices of 4-120 words).

On the CPU the model is made almost free (a 1-layer, 32-wide random BERT with
all-MiniLM-L6-v2's tokenizer), so the pass time is the host's share: tokenization, requests,
scheduling, batch building, pooling and outputs. On a GPU (``--device cuda``) the real MiniLM
runs, and that host share is what bounds the pass. ``--profile FILE`` writes a cProfile of one
more pass (cumulative and own time, top 40 each).

    flock /tmp/cpu_bench.lock .venv/bin/python -m benchmarks.experiments.embed_host_share --passes 3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# a user's default (the other benchmarks, imported below, turn it off for their peers)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import torch

from benchmarks.common import cpu_banner
from benchmarks.gpu_check import corpus


def tiny_bert(folder: Path) -> Path:
    """A 1-layer, 32-wide random BERT under MiniLM's tokenizer and sentence-transformers
    modules (mean pooling, normalize)."""
    from transformers import BertConfig, BertModel

    from cenote.config import default_model_path

    source = default_model_path()
    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=30522,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    for item in source.iterdir():
        if item.name == "config.json" or item.suffix in (".safetensors", ".bin", ".onnx"):
            continue
        if item.is_dir():
            if item.name.endswith(("_Pooling", "_Normalize")):
                shutil.copytree(item, folder / item.name)
        else:
            shutil.copy(item, folder / item.name)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", help="default: the tiny BERT on cpu, MiniLM on cuda")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()

    from cenote import LLM
    from cenote.config import default_model_path

    model = args.model
    if model is None:
        tiny = args.device == "cpu"
        model = str(tiny_bert(Path(tempfile.mkdtemp())) if tiny else default_model_path())
    print(
        f"{cpu_banner()}; device {args.device}; model {model}; step budget "
        f"{args.max_num_batched_tokens or 'default'} tokens, {args.max_num_seqs} requests"
    )
    texts = corpus()
    dtype = "float32" if args.device == "cpu" else "auto"
    llm = LLM(
        model,
        device=args.device,
        dtype=dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )

    def one_pass() -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    llm.embed(texts[:512], truncate_prompt_tokens=-1, use_tqdm=False)  # warm-up
    times = [one_pass() for _ in range(args.passes)]
    print(
        f"{len(texts)} texts, s a pass: " + " / ".join(f"{t:.3f}" for t in times)
        + f"; best {len(texts) / min(times):,.0f} texts/s"
    )  # fmt: skip
    if args.profile is not None:
        profile = cProfile.Profile()
        profile.runcall(one_pass)
        text = io.StringIO()
        for key in ("cumulative", "tottime"):
            pstats.Stats(profile, stream=text).sort_stats(key).print_stats(40)
        args.profile.write_text(text.getvalue(), encoding="utf-8")
        print(f"profile: {args.profile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
