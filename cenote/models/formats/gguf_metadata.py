"""GGUF metadata read as Hugging Face config values: what every architecture reads alike.

Shared by the decoder and encoder readers (``gguf_decoders.py``, ``gguf_encoders.py``) and the
tokenizer (``gguf_tokenizer.py``); the loader (``cenote/models/gguf_loader.py``) joins them.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from cenote.models.formats.gguf_file import GGUFFile

# general.architecture -> (HF architectures entry, HF model_type)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "bert": ("BertModel", "bert"),
    "nomic-bert": ("NomicBertModel", "nomic_bert"),
}
# BERT-family encoders: their config, WordPiece tokenizer and tensor names are in gguf_encoders.py
ENCODER_ARCHITECTURES = frozenset({"bert", "nomic-bert"})
CONTROL_TOKEN_TYPE = 3  # llama.cpp token_type for special tokens like <|im_start|>
USER_DEFINED_TOKEN_TYPE = 4  # llama.cpp token_type for added, non-special tokens like <think>


def read_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The value of metadata `key` (a str, number, bool or list), or `default` when absent."""
    value = reader.fields.get(key)
    return default if value is None else value


def float32_value(value: float) -> float:
    """The shortest decimal that round-trips a float32 (GGUF stores 1e-5 as 9.9999997e-06)."""
    return float(str(np.float32(value)))


def arch_field(reader: GGUFFile, architecture: str, key: str, default: Any = None) -> Any:
    """The architecture's metadata ``{architecture}.{key}``, or ``default`` when absent."""
    return read_field(reader, f"{architecture}.{key}", default)


def base_config(reader: GGUFFile, architecture: str) -> dict[str, Any]:
    """The config.json keys every architecture reads alike: its Hugging Face names, sizes,
    context length, vocabulary size and padding token."""
    hf_architecture, model_type = ARCHITECTURES[architecture]
    arch = partial(arch_field, reader, architecture)
    config: dict[str, Any] = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "hidden_size": arch("embedding_length"),
        "intermediate_size": arch("feed_forward_length"),
        "num_hidden_layers": arch("block_count"),
        "num_attention_heads": arch("attention.head_count"),
        "max_position_embeddings": arch("context_length"),
        "vocab_size": arch("vocab_size") or len(read_field(reader, "tokenizer.ggml.tokens") or []),
    }
    pad_token_id = read_field(reader, "tokenizer.ggml.padding_token_id")
    if pad_token_id is not None:
        config["pad_token_id"] = pad_token_id
    return config
