"""Tiny GTE v1.5 / multilingual models as the Hub ships them (Alibaba-NLP's remote-code
``NewModel`` folders), built from transformers' native ``GteModel``, which is the reference.

transformers loads remote-code checkpoints into ``GteModel`` by its own conversion mapping
(``new.`` prefix, ``qkv_proj`` / ``up_gate_proj`` split) and ``save_pretrained`` writes them
back in that layout; only config.json differs: the factory rewrites it into the remote code's
keys (``rope_theta`` + ``rope_scaling``, ``model_type: new``, ``auto_map``).

NTK scaling (``rope_scaling {"type": "ntk", "factor": f}``, gte-large-en-v1.5 and
gte-multilingual-base) has no transformers rope type; ``ntk_inv_freq`` below is written from
the remote code's ``NTKScalingRotaryEmbedding`` math (https://kexue.fm/archives/9706) and put
into the reference's rotary buffers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .seeded import hf_config, random_model
from .vocab import RETRIEVAL_BERT_SPECIALS, VOCAB_SIZE, write_retrieval_tokenizer

ROPE_THETA = 1000.0  # small: rotations differ visibly over tiny prompts
GTE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    type_vocab_size=0,  # gte-base-en-v1.5; gte-large and multilingual have 1
    pad_token_id=0,
    hidden_dropout_prob=0.0,
    classifier_dropout=0.0,
    rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
)
_AUTO_MAP = {
    "AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
    "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel",
    "AutoModelForSequenceClassification": "Alibaba-NLP/new-impl--modeling.NewForSequenceClassification",
}


def ntk_inv_freq(
    theta: float, head_dim: int, factor: float, mixed_b: float | None = None
) -> torch.Tensor:
    """Fixed NTK: base ``theta * factor``, then every frequency over ``factor ** (2 / dim)``;
    mixed (``mixed_b``): base ``theta``, frequency m (from 1) over ``exp(a m^b)`` with
    ``a = ln(factor) / (dim / 2)^b``. The remote code applies it whenever factor > 1, at any
    length."""
    base = theta * factor if mixed_b is None else theta
    inv_freq = base ** -(torch.arange(0, head_dim, 2).double() / head_dim)
    if mixed_b is None:
        return (inv_freq / factor ** (2 / head_dim)).float()
    a = math.log(factor) / (head_dim / 2) ** mixed_b
    lambdas = torch.tensor([math.exp(a * m**mixed_b) for m in range(1, head_dim // 2 + 1)])
    return (inv_freq / lambdas.double()).float()


def hub_config(config: dict[str, Any], ntk_factor: float | None, head: str) -> dict[str, Any]:
    """transformers' saved GteConfig -> config.json as Alibaba-NLP's folders write it."""
    hub = {k: v for k, v in config.items() if k not in ("rope_parameters", "architectures")}
    return {
        **hub,
        "architectures": [f"New{head}"],
        "model_type": "new",
        "auto_map": _AUTO_MAP,
        "rope_theta": config["rope_parameters"]["rope_theta"],
        "rope_scaling": {"type": "ntk", "factor": ntk_factor} if ntk_factor else None,
        "position_embedding_type": "rope",
        "layer_norm_type": "layer_norm",
        "logn_attention_scale": False,
        "logn_attention_clip1": False,
        "pack_qkv": True,
        "unpad_inputs": False,
        "use_memory_efficient_attention": False,
    }


def make_gte(
    folder: Path,
    head: str = "Model",
    seed: int = 0,
    ntk_factor: float | None = None,
    hub_layout: bool = True,
    **overrides: Any,
) -> torch.nn.Module:
    """Save a seeded random ``Gte<head>`` (``Model`` or ``ForSequenceClassification``) into
    ``folder`` and return it (the reference, NTK-scaled when ``ntk_factor``). ``hub_layout``:
    config.json and tensor prefix (``new.``) as the Hub's remote-code folders; else as
    transformers saves it (``GteModel``, which sentence-transformers loads)."""
    config = hf_config("GteConfig", GTE, overrides)
    model = random_model(f"Gte{head}", config, seed)
    if ntk_factor:
        rotary = model.rotary_emb if head == "Model" else model.gte.rotary_emb
        head_dim = config.hidden_size // config.num_attention_heads
        scaled = ntk_inv_freq(ROPE_THETA, head_dim, ntk_factor)
        rotary.inv_freq.copy_(scaled)
        rotary.original_inv_freq.copy_(scaled)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_retrieval_tokenizer(folder, RETRIEVAL_BERT_SPECIALS, token_types=True)
    if hub_layout:
        path = folder / "config.json"
        path.write_text(json.dumps(hub_config(json.loads(path.read_text()), ntk_factor, head)))
        weights = folder / "model.safetensors"
        tensors = load_file(weights)
        renamed = {_hub_name(name): t for name, t in tensors.items()}
        save_file(renamed, weights, metadata={"format": "pt"})
    return model


def _hub_name(name: str) -> str:
    return "new." + name[len("gte.") :] if name.startswith("gte.") else name
