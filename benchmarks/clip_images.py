"""Image embedding throughput of a full-size CLIP ViT-B/32 (random weights, CLIPConfig's
defaults: openai/clip-vit-base-patch32's shape): cenote vs transformers (``CLIPImageProcessorPil``
+ ``CLIPModel.get_image_features`` in batches), preprocessing included on both sides. Run from
``embed_architectures.py --clip-images N``; ``python -m benchmarks.clip_images --max-images K``
times calls of 1, 2, ... K images (one step each, every one a new vision-tower row count)
twice: the first pass builds oneDNN's primitives for each count, the second reuses them."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F


def build_clip_folder(root: Path, seed: int = 0) -> Path:
    """A random ViT-B/32 CLIP folder with its image processor and all-MiniLM-L6-v2's tokenizer
    (only images are embedded here; cenote loads a tokenizer with every model)."""
    import transformers
    from tokenizers import Tokenizer

    from cenote.config import default_model_path

    torch.manual_seed(seed)
    model = transformers.CLIPModel(transformers.CLIPConfig()).float().eval()
    folder = root / "clip-vit-b32"
    model.save_pretrained(folder)
    tokenizer = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]"
    ).save_pretrained(folder)
    transformers.CLIPImageProcessorPil().save_pretrained(folder)
    return folder


def make_images(num_images: int, seed: int = 0) -> list:
    """Photo-sized noise images of a few aspect ratios (640 x 480, 480 x 640, 800 x 600)."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    shapes = [(640, 480), (480, 640), (800, 600)]
    images = []
    for i in range(num_images):
        width, height = shapes[i % len(shapes)]
        pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
        images.append(Image.fromarray(pixels.numpy()))
    return images


def run_reference(model, processor, batch: list, dtype: torch.dtype) -> torch.Tensor:
    """transformers' image embeddings of ``batch``: its processor, then ``get_image_features``."""
    pixels = processor(images=batch, return_tensors="pt")["pixel_values"].to(dtype)
    with torch.inference_mode():
        return model.get_image_features(pixel_values=pixels).pooler_output.float()


def bench_clip(
    root: Path, num_images: int, threads: int, dtypes: list[str], batch_size: int
) -> list[str]:
    """Rows of images/s per dtype and engine, the ratio and the min cosine."""
    import transformers

    from cenote import LLM

    folder = build_clip_folder(root)
    images = make_images(num_images)
    processor = transformers.CLIPImageProcessorPil.from_pretrained(folder)
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        torch.set_num_threads(threads)
        model = transformers.CLIPModel.from_pretrained(folder).to(dtype).eval()
        run_reference(model, processor, images[:batch_size], dtype)  # warm-up
        start = time.perf_counter()
        theirs = torch.cat(
            [
                run_reference(model, processor, images[i : i + batch_size], dtype)
                for i in range(0, num_images, batch_size)
            ]
        )
        their_seconds = time.perf_counter() - start
        del model
        llm = LLM(str(folder), dtype=dtype_name, num_threads=threads)
        prompts = [{"image": image} for image in images]
        llm.embed(prompts[:batch_size], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.embed(prompts, use_tqdm=False)
        our_seconds = time.perf_counter() - start
        del llm
        ours = torch.stack([o.outputs.data.float() for o in outputs])
        cosine = F.cosine_similarity(ours, theirs, dim=-1)
        ratio = their_seconds / our_seconds
        for engine, seconds, extra in (
            ("hf", their_seconds, ""),
            ("cenote", our_seconds, f"{ratio:6.2f} {float(cosine.min()):8.6f}"),
        ):
            rows.append(
                f"{'clip-vit-b32':16} {dtype_name:9} {engine:8} {num_images:5d} img "
                f"{seconds:8.2f} {num_images / seconds:8.1f} {extra}"
            )
        print(rows[-2], rows[-1], sep="\n", flush=True)
    return rows


def bench_image_counts(root: Path, max_images: int, threads: int, dtype_name: str) -> list[str]:
    """Seconds of calls of 1 .. ``max_images`` images, a cold pass then a warm pass (the same
    calls again), and what the cold pass spent beyond the warm one."""
    from cenote import LLM

    folder = build_clip_folder(root)
    images = make_images(max_images)
    llm = LLM(str(folder), dtype=dtype_name, num_threads=threads)
    prompts = [{"image": image} for image in images]
    passes = []
    for _ in range(2):
        start = time.perf_counter()
        for count in range(1, max_images + 1):
            llm.embed(prompts[:count], use_tqdm=False)
        passes.append(time.perf_counter() - start)
    num_images = max_images * (max_images + 1) // 2
    rows = [
        f"clip-vit-b32 {dtype_name} calls of 1..{max_images} images ({num_images} images): "
        f"cold {passes[0]:.2f} s ({num_images / passes[0]:.1f} img/s), warm {passes[1]:.2f} s "
        f"({num_images / passes[1]:.1f} img/s), cold - warm {passes[0] - passes[1]:.2f} s"
    ]
    print(rows[0], flush=True)
    return rows


if __name__ == "__main__":
    import argparse
    import os
    import tempfile

    from benchmarks.common import cpu_banner

    parser = argparse.ArgumentParser(description="CLIP vision tower: cold vs warm image counts")
    parser.add_argument("--max-images", type=int, default=12)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_banner()} threads={args.threads}")
    with tempfile.TemporaryDirectory(prefix="cenote-clip-counts-") as tmp:
        for dtype in args.dtypes.split(","):
            bench_image_counts(Path(tmp), args.max_images, args.threads, dtype)
