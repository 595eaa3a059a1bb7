"""BGE-M3's three outputs for a corpus: one multi-task request per text (one trunk pass) vs
three single-task calls (``embed``, ``embed_sparse``, ``token_embed``: three passes), on a
random XLM-R trunk with BGE-M3's two heads, fp32. Prints texts/s of both, their ratio and the
largest difference between the outputs, with the CPU.

    python -m benchmarks.experiments.bge_m3_multi --texts 256 --length 128 --threads 2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_banner

TASKS = ("embed", "embed_sparse", "token_embed")


def build_folder(root: Path, hidden: int, layers: int) -> Path:
    """A random XLM-R trunk (``hidden``, ``layers``; heads of 64) with random
    ``sparse_linear.pt`` / ``colbert_linear.pt`` beside it."""
    from tests.factories.encoders import make_encoder_classifier

    folder = root / "bge-m3-shaped"
    make_encoder_classifier(
        folder, "xlm-roberta", "Model", seed=0, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, intermediate_size=4 * hidden,
        max_position_embeddings=514,
    )  # fmt: skip
    torch.manual_seed(1)
    torch.save(torch.nn.Linear(hidden, 1).state_dict(), folder / "sparse_linear.pt")
    torch.save(torch.nn.Linear(hidden, hidden).state_dict(), folder / "colbert_linear.pt")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--length", type=int, default=128, help="tokens per text")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="best of")
    args = parser.parse_args()

    from cenote import LLM

    with tempfile.TemporaryDirectory() as root:
        folder = build_folder(Path(root), args.hidden, args.layers)
        llm = LLM(str(folder), dtype="float32", num_threads=args.threads)
        generator = torch.Generator().manual_seed(0)
        vocab = llm.config.model.vocab_size
        prompts = [
            {"prompt_token_ids": [0, *torch.randint(5, vocab, (args.length - 2,),
                                                    generator=generator).tolist(), 2]}
            for _ in range(args.texts)
        ]  # fmt: skip
        llm.encode(prompts[:8], pooling_task=TASKS, use_tqdm=False)  # warm-up

        def one_pass() -> list:
            return llm.encode(prompts, pooling_task=TASKS, use_tqdm=False)

        def three_passes() -> list:
            return [llm.encode(prompts, pooling_task=t, use_tqdm=False) for t in TASKS]

        timings = {}
        results = {}
        for name, run in (
            ("one multi-task pass", one_pass),
            ("three single-task calls", three_passes),
        ):
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                results[name] = run()
                best = min(best, time.perf_counter() - start)
            timings[name] = best
        multi, singles = results["one multi-task pass"], results["three single-task calls"]
        diff = max(
            (m.outputs[t].data - s.outputs.data).abs().max().item()
            for i, t in enumerate(TASKS)
            for m, s in zip(multi, singles[i], strict=True)
        )
    print(f"{cpu_banner(args.threads)}; torch {torch.__version__}")
    print(
        f"XLM-R trunk hidden {args.hidden} x {args.layers} layers (random weights), fp32; "
        f"{args.texts} texts x {args.length} tokens; best of {args.repeats}"
    )
    for name, seconds in timings.items():
        print(f"  {name:26s} {seconds:7.3f} s  {args.texts / seconds:8.1f} texts/s")
    ratio = timings["three single-task calls"] / timings["one multi-task pass"]
    print(f"  one pass is {ratio:.2f}x faster; largest output difference {diff:.2e}")


if __name__ == "__main__":
    main()
