"""NomicBERT (nomic-embed-text v1 / v1.5) over a flat, unpadded token stream.

BERT's post-norm layout with rotary embeddings instead of position embeddings, a fused QKV
without biases and a SwiGLU MLP (``fc2(silu(fc12(x)) * fc11(x))``). Checkpoints use nomic's
layout (``emb_ln``, ``encoder.layers.N.attn.Wqkv``, ``mlp.fc11``, ``norm1``...), which
transformers also writes on ``save_pretrained``; transformers' own names load too. Configs come
in transformers' names (``hidden_size``, ``rope_parameters``) or nomic's (``n_embd``,
``rotary_emb_base``). Variants the remote code allows but this file does not implement (partial
or interleaved rotary, pre-norm, biases, MoE layers, scaled rotary) are refused at load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.models.checkpoint_map import (
    CheckpointMap,
    Slot,
    fused_slots,
    linear_slots,
    load_checkpoint,
)
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import TrunkLinear
from cenote.models.layers.norm import LayerNorm
from cenote.models.layers.rotary import RotaryEmbedding, apply_rotary

SUPPORTED_ACTIVATIONS = ("swiglu", "silu")  # the MLP gate's activation: SiLU
# nomic config key -> the only value implemented here
_REQUIRED = {
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "prenorm": False,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "causal": False,
    "use_rms_norm": False,
    "moe_every_n_layers": 0,
    "rotary_scaling_factor": None,
}


def _first(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def check_variant(config: dict[str, Any]) -> None:
    """Refuse what this implementation does not compute, naming what it supports."""
    activation = _first(config, "activation_function", "hidden_act", default="swiglu")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"NomicBERT activation {activation!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ACTIVATIONS)} (a SwiGLU MLP)"
        )
    for key, value in _REQUIRED.items():
        if key in config and config[key] != value and not (value == 0 and config[key] is None):
            supported = ", ".join(f"{k}={v}" for k, v in _REQUIRED.items())
            raise ValueError(
                f"NomicBERT {key}={config[key]!r} is not supported; supported: {supported}"
            )
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(
            f"NomicBERT rope_type {params['rope_type']!r} is not supported; supported: default"
        )


class NomicBertLayer(nn.Module):
    """``x = norm1(x + out_proj(attn(x)))``; ``x = norm2(x + fc2(silu(fc12 x) * fc11 x))``."""

    def __init__(self, hidden: int, heads: int, head_dim: int, inner: int, eps: float, i: int):
        super().__init__()
        self.Wqkv = TrunkLinear(hidden, 3 * heads * head_dim, bias=False)
        self.attn = Attention(heads, head_dim, heads, i, head_dim**-0.5)
        self.out_proj = TrunkLinear(heads * head_dim, hidden, bias=False)
        self.norm1 = LayerNorm(hidden, eps=eps)
        self.fc11 = TrunkLinear(hidden, inner, bias=False)  # up
        self.fc12 = TrunkLinear(hidden, inner, bias=False)  # gate
        self.fc2 = TrunkLinear(inner, hidden, bias=False)
        self.norm2 = LayerNorm(hidden, eps=eps)
        self.act = get_activation("silu")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.Wqkv(x).chunk(3, dim=-1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        x = self.norm1.normalize_(x + self.out_proj(self.attn(q, k, v)))  # norms: over the sums
        return self.norm2.normalize_(x + self.fc2(self.act(self.fc12(x)) * self.fc11(x)))


# transformers' names (after ``layers.N.``) -> ours, which follow nomic's
_NATIVE_LAYER_NAMES = {
    "self_attn.o_proj": "out_proj",
    "mlp.up_proj": "fc11",
    "mlp.gate_proj": "fc12",
    "mlp.down_proj": "fc2",
    "post_attention_layernorm": "norm1",
    "post_mlp_layernorm": "norm2",
}
_NATIVE_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# our layer modules -> whether they have a bias
_LAYER_MODULES = {
    "Wqkv": False,
    "out_proj": False,
    "fc11": False,
    "fc12": False,
    "fc2": False,
    "norm1": True,
    "norm2": True,
}
# our layer modules -> nomic's names (after ``encoder.layers.N.``), where they differ
_NOMIC_LAYER_NAMES = {
    "Wqkv": "attn.Wqkv",
    "out_proj": "attn.out_proj",
    "fc11": "mlp.fc11",
    "fc12": "mlp.fc12",
    "fc2": "mlp.fc2",
}


class NomicBertModel(nn.Module):
    """``forward(input_ids, positions, token_type_ids) -> hidden_states [num_tokens, hidden]``."""

    is_causal = False
    checkpoint_prefixes = ("nomic_bert.", "bert.", "model.")

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        check_variant(config)
        self.config = config
        hidden = int(_first(config, "hidden_size", "n_embd"))
        heads = int(_first(config, "num_attention_heads", "n_head"))
        head_dim = int(_first(config, "head_dim", default=hidden // heads))
        inner = int(_first(config, "intermediate_size", "n_inner", default=4 * hidden))
        eps = float(_first(config, "layer_norm_eps", "layer_norm_epsilon", default=1e-12))
        theta = (config.get("rope_parameters") or {}).get("rope_theta")
        theta = theta if theta is not None else _first(config, "rotary_emb_base", default=1000.0)
        self.hidden_size = hidden
        self.rotary = RotaryEmbedding(head_dim, {"rope_theta": float(theta)})
        self.word_embeddings = Embedding(config["vocab_size"], hidden)
        self.token_type_embeddings = Embedding(int(config.get("type_vocab_size", 2)), hidden)
        self.emb_ln = LayerNorm(hidden, eps=eps)
        num_layers = int(_first(config, "num_hidden_layers", "n_layer"))
        self.layers = nn.ModuleList(
            NomicBertLayer(hidden, heads, head_dim, inner, eps, i) for i in range(num_layers)
        )
        self.checkpoint_map = self._checkpoint_map()

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        x = self.word_embeddings(input_ids)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.emb_ln.normalize_(x)  # x: this step's sum
        cos, sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x  # [num_tokens, hidden]

    def _checkpoint_map(self) -> CheckpointMap:
        """nomic's names, or transformers' (separate q/k/v as thirds of ``Wqkv``): a tensor
        fills its parameter under either."""
        slots = {
            "embeddings.word_embeddings.weight": Slot("word_embeddings.weight"),
            "embeddings.token_type_embeddings.weight": Slot("token_type_embeddings.weight"),
            **linear_slots("emb_ln", "emb_ln"),
            **linear_slots("embeddings.LayerNorm", "emb_ln"),
        }
        for i in range(len(self.layers)):
            dst = f"layers.{i}"
            for ours, bias in _LAYER_MODULES.items():
                native = f"encoder.layers.{i}.{_NOMIC_LAYER_NAMES.get(ours, ours)}"
                slots.update(linear_slots(native, f"{dst}.{ours}", bias))
            for theirs, ours in _NATIVE_LAYER_NAMES.items():
                slots.update(
                    linear_slots(f"layers.{i}.{theirs}", f"{dst}.{ours}", _LAYER_MODULES[ours])
                )
            qkv = [f"layers.{i}.{name}" for name in _NATIVE_QKV]
            slots.update(fused_slots(qkv, f"{dst}.Wqkv", bias=False))
        # the CLS pooler, masked-LM and classifier heads of other tasks' checkpoints
        unused = (r"pooler\.", r"lm_head\.", r"cls\.", r"classifier\.", r"embeddings\.position_ids")
        return CheckpointMap(slots, prefixes=self.checkpoint_prefixes, unused=unused)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, self.checkpoint_map, weights)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()
