"""Tiny Llama-family decoders saved by transformers: causal LMs for generation, causal LMs and
sequence classifiers for pooling, and Qwen2 reward models laid out as the Hub's remote code."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from .seeded import hf_config, perturb, random_model, set_config
from .vocab import (
    DECODER_SPECIALS,
    GENERATION_SPECIALS,
    VOCAB_SIZE,
    write_byte_level_tokenizer,
    write_generation_tokenizer,
    write_tokenizer,
)

TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# ---- generation: <pad> <s> </s> + 253 words -------------------------------------------------
GENERATION_VOCAB_SIZE = 256
BOS_ID, EOS_ID = 1, 2
FIRST_WORD_ID = len(GENERATION_SPECIALS)
GENERATION_DECODER = dict(
    **TINY_DECODER,
    vocab_size=GENERATION_VOCAB_SIZE,
    pad_token_id=0,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)
# family -> (config class, causal-LM class, config overrides)
DECODER_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
}
# ---- pooling heads: the pooling tests' words ------------------------------------------------
POOLING_DECODER = dict(**TINY_DECODER, vocab_size=VOCAB_SIZE, tie_word_embeddings=False)
# variant -> (config class, class prefix, config overrides)
POOLING_VARIANTS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "Llama", {}),
    "qwen2": ("Qwen2Config", "Qwen2", {}),
    "qwen3": ("Qwen3Config", "Qwen3", dict(head_dim=16)),
}


def save_generation_decoder(folder: Path, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` saved with the generation tokenizer (its vocabulary size)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_generation_tokenizer(folder, model.config.vocab_size)
    return model


def make_decoder(folder: Path, family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Save a seeded random fp32 ``family`` causal LM + the generation tokenizer into ``folder``;
    returns the transformers model."""
    config_class, model_class, family_overrides = DECODER_FAMILIES[family]
    config = hf_config(config_class, GENERATION_DECODER, family_overrides, overrides)
    return save_generation_decoder(folder, random_model(model_class, config, seed))


def make_pooling_decoder(folder: Path, variant: str, head: str, seed: int = 0, **overrides):
    """Save a seeded random ``<Variant><head>`` (ForCausalLM / ForSequenceClassification) with
    the pooling tests' tokenizer."""
    config_class, prefix, variant_overrides = POOLING_VARIANTS[variant]
    config = hf_config(config_class, POOLING_DECODER, variant_overrides, overrides)
    model = random_model(f"{prefix}{head}", config, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder, DECODER_SPECIALS, pair_segments=False)
    return model


def make_qwen2_reward(
    folder: Path, architecture: str, num_labels: int, seed: int = 0
) -> tuple[torch.nn.Module, torch.nn.Sequential]:
    """Save a seeded random Qwen2 reward model as the Hub's remote-code checkpoints lay it out:
    the ``Qwen2Model`` trunk under ``model.`` and an MLP head ``score.0`` / ``score.2``.
    Returns the trunk and the head (fp32, eval) for hand computation."""
    from safetensors.torch import save_file

    config = transformers.Qwen2Config(**POOLING_DECODER)
    trunk = perturb(transformers.Qwen2Model(config), seed)
    torch.manual_seed(seed + 1)
    hidden = config.hidden_size
    head = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, num_labels)
    ).eval()
    tensors = {f"model.{name}": t for name, t in trunk.state_dict().items()}
    tensors.update({f"score.{name}": t for name, t in head.state_dict().items()})
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, folder / "model.safetensors")
    config.save_pretrained(folder)
    set_config(folder, architectures=[architecture], num_labels=num_labels)
    write_tokenizer(folder, DECODER_SPECIALS, pair_segments=False)
    return trunk, head


# byte-level merges of JSON's frequent pairs: multi-byte tokens the grammar must split or join
JSON_MERGES = [("{", '"'), ('"', ":"), (",", '"'), ('"', "}"), ("Ġ", '"'), ("t", "r"), ("tr", "u")]


def make_byte_level_decoder(folder: Path, family: str, seed: int = 0, **overrides):
    """A seeded random ``family`` causal LM over a byte-level BPE tokenizer (``vocab.
    write_byte_level_tokenizer``), its vocabulary padded past the tokenizer's as checkpoints
    often are (those ids decode to nothing). Random weights write bytes at random: only a
    grammar makes them write JSON."""
    folder.mkdir(parents=True, exist_ok=True)
    num_tokens = write_byte_level_tokenizer(folder, JSON_MERGES)
    config_class, model_class, family_overrides = DECODER_FAMILIES[family]
    settings = {**GENERATION_DECODER, "vocab_size": -(-(num_tokens + 16) // 64) * 64}
    settings["max_position_embeddings"] = 1024  # room for whole JSON documents
    config = hf_config(config_class, settings, family_overrides, overrides)
    model = random_model(model_class, config, seed)
    model.save_pretrained(folder)
    return model
