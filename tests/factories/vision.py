"""Tiny CLIP and SigLIP folders (random weights, saved by transformers with their image
processor and a word-level tokenizer) and generated images."""

from __future__ import annotations

import io
from pathlib import Path

import torch
import transformers
from PIL import Image
from tokenizers import processors

from .seeded import perturb
from .vocab import save_tokenizer, word_tokenizer

CLIP_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<pad>", "<unk>"]  # eos id 1 (not 2)
WORDS = ["a", "photo", "of", "cat", "dog", "red", "blue", "square", "circle"]
TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=24,
    layer_norm_eps=1e-5,
)
VISION = dict(
    hidden_size=48,
    intermediate_size=53,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=30,
    patch_size=6,
    layer_norm_eps=1e-5,
)
IMAGE_SIZE = VISION["image_size"]


def _tokenizer(folder: Path, vocab_size: int) -> None:
    tokenizer = word_tokenizer(CLIP_SPECIALS, vocab_size, WORDS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[("<|startoftext|>", 0), ("<|endoftext|>", 1)],
    )
    names = dict(bos_token="<|startoftext|>", eos_token="<|endoftext|>", pad_token="<pad>")
    save_tokenizer(tokenizer, folder, CLIP_SPECIALS, names)


def make_clip(folder: Path, kind: str = "CLIPModel", seed: int = 0) -> torch.nn.Module:
    """A seeded ``CLIPModel`` (or ``CLIPTextModelWithProjection`` / ``CLIPTextModel`` /
    ``CLIPVisionModelWithProjection`` / ``CLIPVisionModel``: one tower; the vision ones saved
    without a tokenizer, as image-only folders come) folder; returns the model."""
    text = dict(TEXT, bos_token_id=0, eos_token_id=1, pad_token_id=2, hidden_act="quick_gelu")
    vision = dict(VISION, hidden_act="quick_gelu")
    torch.manual_seed(seed)
    if kind == "CLIPModel":
        config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
    elif "Vision" in kind:
        config = transformers.CLIPVisionConfig(**vision, projection_dim=24)
    else:
        config = transformers.CLIPTextConfig(**text, projection_dim=24)
    model = perturb(getattr(transformers, kind)(config))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if "Vision" not in kind:
        _tokenizer(folder, TEXT["vocab_size"])
    transformers.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(folder)
    return model


def make_siglip(folder: Path, kind: str = "SiglipModel", seed: int = 0) -> torch.nn.Module:
    """A seeded ``SiglipModel`` (no class token, attention-pooling head), ``SiglipTextModel`` or
    ``SiglipVisionModel`` (saved without a tokenizer) folder; returns the model."""
    text = dict(TEXT, bos_token_id=0, eos_token_id=1, pad_token_id=2, projection_size=48)
    text["hidden_act"] = vision_act = "gelu_pytorch_tanh"
    vision = dict(VISION, hidden_act=vision_act)
    torch.manual_seed(seed)
    if kind == "SiglipModel":
        config = transformers.SiglipConfig(text_config=text, vision_config=vision)
    elif kind == "SiglipVisionModel":
        config = transformers.SiglipVisionConfig(**vision)
    else:
        config = transformers.SiglipTextConfig(**text)
    model = perturb(getattr(transformers, kind)(config))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if "Vision" not in kind:
        _tokenizer(folder, TEXT["vocab_size"])
    transformers.SiglipImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(folder)
    return model


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A seeded RGB noise image with a colored rectangle (not square, so crops matter)."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    pixels[height // 4 : height // 2, width // 3 : width // 2] = torch.tensor([200, 30, 40])
    return Image.fromarray(pixels.numpy())


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
