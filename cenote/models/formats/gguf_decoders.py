"""Llama-family GGUF files (llama.cpp's ``llama``, ``qwen2``, ``qwen3``) read as Hugging Face
checkpoints: config keys, rope scaling, tensor names and llama's rotary row order.

Tensors take the Hugging Face names: ``blk.3.attn_q.weight`` ->
``model.layers.3.self_attn.q_proj.weight``; llama's Q/K rows come back in Hugging Face's order.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import torch

from cenote.models.formats.gguf_file import GGUFError, GGUFFile
from cenote.models.formats.gguf_metadata import arch_field, base_config, float32_value, read_field

# llama.cpp tensor name (without "blk.N." and ".weight"/".bias") -> HF parameter name
GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp derives for itself (rope_freqs: llama3 rope scaling factors); HF has none.
SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})


def build_decoder_config(reader: GGUFFile, architecture: str) -> dict[str, Any]:
    """A decoder's Hugging Face config.json-style dict from `{arch}.*` and `tokenizer.ggml.*`."""
    arch = partial(arch_field, reader, architecture)
    config = base_config(reader, architecture)
    config.update(
        num_key_value_heads=arch("attention.head_count_kv", config["num_attention_heads"]),
        rms_norm_eps=float32_value(arch("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float32_value(arch("rope.freq_base", 10000.0)),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=read_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=read_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    head_dim = arch("attention.key_length")
    if head_dim is not None:
        config["head_dim"] = head_dim
    rope_scaling = build_rope_scaling(reader, architecture)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def build_rope_scaling(reader: GGUFFile, architecture: str) -> dict[str, Any] | None:
    """HF `rope_scaling` for linear / yarn scaling, None when the file states none."""
    kind = read_field(reader, f"{architecture}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise GGUFError(f"rope scaling {kind!r} is not supported; supported: linear, yarn")
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": float32_value(read_field(reader, f"{architecture}.rope.scaling.factor", 1.0)),
    }
    original = read_field(reader, f"{architecture}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a llama.cpp tensor name ("blk.3.attn_q.weight")."""
    match = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", gguf_name)
    if match is None:
        raise GGUFError(f"unexpected GGUF tensor name {gguf_name!r}")
    layer, base, kind = match.groups()
    if layer is None and base in GLOBAL_TENSOR_NAMES:
        return f"{GLOBAL_TENSOR_NAMES[base]}.{kind}"
    if layer is not None and base in LAYER_TENSOR_NAMES:
        return f"model.layers.{layer}.{LAYER_TENSOR_NAMES[base]}.{kind}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no Hugging Face name in this loader")


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row permutation for llama.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... while HF rotates halves
    (x0, x_{d/2}), ...; the converter reorders each head's rows from halves to pairs. Reading
    each head's rows as `[head_dim // 2, 2]` and transposing restores `[2, head_dim // 2]`.
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    # [num_heads, head_dim // 2, 2, *rest] -> [num_heads, 2, head_dim // 2, *rest]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return per_head.transpose(1, 2).reshape(rows, *rest)
