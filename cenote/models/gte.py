"""GTE v1.5 / multilingual (Alibaba-NLP's ``NewModel``, transformers' ``GteModel``) over a flat,
unpadded token stream.

BERT's post-norm layout with rotary embeddings instead of position embeddings (optionally NTK
scaled: ``rope_scaling {"type": "ntk", "factor": f}``), biased fused QKV and output projections
and a gated MLP: ``down_proj(act(gate) * up)`` where ``up_gate_proj`` (no bias) holds ``up``
then ``gate``. Token-type embeddings exist only when ``type_vocab_size > 0`` (gte-base-en-v1.5
has none). Checkpoints use the remote code's names (``encoder.layer.N.attention.qkv_proj``,
``attn_ln``, ``mlp.up_gate_proj``, ``mlp_ln``), which transformers also writes on
``save_pretrained`` (its in-memory names are a conversion of these).

- NewModel / GteModel: the trunk (sentence-transformers pools its CLS token).
- NewForSequenceClassification / GteForSequenceClassification (gte-multilingual-reranker):
  ``classifier(tanh(pooler.dense(h_[CLS])))``, the head in fp32.

Variants the remote code allows but this file does not compute (logn attention scaling, RMS
norm, absolute positions, dynamic RoPE) are refused at load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.models.bert_classifiers import TanhPoolerHead
from cenote.models.checkpoint_map import CheckpointMap, Slot, linear_slots
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import TrunkLinear, linear_add_norm
from cenote.models.layers.norm import LayerNorm
from cenote.models.layers.rotary import RotaryEmbedding, apply_rotary

# remote-code config key -> the only value implemented here (absent keys take these)
_REQUIRED: dict[str, Any] = {
    "position_embedding_type": "rope",
    "layer_norm_type": "layer_norm",
    "logn_attention_scale": False,
    "logn_attention_clip1": False,
}
SUPPORTED_ROPE_SCALING = ("ntk",)  # the remote code builds no other


def check_variant(config: dict[str, Any]) -> None:
    """Refuse what this implementation does not compute, naming what it supports."""
    for key, value in _REQUIRED.items():
        if config.get(key, value) != value:
            supported = ", ".join(f"{k}={v!r}" for k, v in _REQUIRED.items())
            raise ValueError(f"GTE {key}={config[key]!r} is not supported; supported: {supported}")
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if scaling and kind not in SUPPORTED_ROPE_SCALING:
        raise ValueError(
            f"GTE rope_scaling type {kind!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_SCALING)} (or none)"
        )


def rope_settings(config: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (transformers' GteConfig) or ``rope_theta`` + ``rope_scaling`` (the
    remote code's NewConfig) as the rotary layer reads them."""
    if config.get("rope_parameters"):
        return {"rope_parameters": config["rope_parameters"]}
    scaling = config.get("rope_scaling") or {}
    theta = float(config.get("rope_theta", 10000.0))
    return {"rope_parameters": {**scaling, "rope_theta": theta}}


class GteLayer(nn.Module):
    """``x = attn_ln(x + o_proj(attn(rope(qkv x))))``;
    ``x = mlp_ln(x + down_proj(act(gate x) * up x))``."""

    def __init__(self, config: dict[str, Any], layer_idx: int) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        inner, eps = config["intermediate_size"], config.get("layer_norm_eps", 1e-12)
        head_dim = hidden // heads
        self.qkv_proj = TrunkLinear(hidden, 3 * hidden)
        self.attn = Attention(heads, head_dim, heads, layer_idx, head_dim**-0.5)
        self.o_proj = TrunkLinear(hidden, hidden)
        self.attn_ln = LayerNorm(hidden, eps=eps)
        self.up_gate_proj = TrunkLinear(hidden, 2 * inner, bias=False)  # [up; gate]
        self.down_proj = TrunkLinear(inner, hidden)
        self.mlp_ln = LayerNorm(hidden, eps=eps)
        self.act = get_activation(config.get("hidden_act", "gelu"))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        x = linear_add_norm(self.o_proj, self.attn(q, k, v), x, self.attn_ln)
        up, gate = self.up_gate_proj(x).chunk(2, dim=-1)  # each [num_tokens, inner]
        return linear_add_norm(self.down_proj, self.act(gate) * up, x, self.mlp_ln)


# checkpoint name (after ``encoder.layer.N.``) -> ours (after ``layers.N.``)
_LAYER_NAMES = {
    "attention.qkv_proj": "qkv_proj",
    "attention.o_proj": "o_proj",
    "attn_ln": "attn_ln",
    "mlp.down_proj": "down_proj",
    "mlp_ln": "mlp_ln",
}


# the CLS pooler and masked-LM head a trunk does not use (a classifier's pooler has a slot,
# which comes first); position-id buffers
_UNUSED = (r"pooler\.", r"lm_head\.", r"embeddings\.position_ids")


class GteModel(nn.Module):
    """``forward(input_ids, positions, token_type_ids) -> hidden_states [num_tokens, hidden]``."""

    is_causal = False

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        check_variant(config)
        self.config = config
        hidden = self.hidden_size = int(config["hidden_size"])
        head_dim = hidden // int(config["num_attention_heads"])
        self.rotary = RotaryEmbedding(head_dim, rope_settings(config))
        self.word_embeddings = Embedding(config["vocab_size"], hidden)
        num_types = int(config.get("type_vocab_size", 0))
        self.token_type_embeddings = Embedding(num_types, hidden) if num_types > 0 else None
        self.emb_ln = LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12))
        self.layers = nn.ModuleList(GteLayer(config, i) for i in range(config["num_hidden_layers"]))
        self.checkpoint_map = CheckpointMap(
            self._trunk_slots(),
            prefixes=("new.", "gte."),
            unused=_UNUSED,
        )

    def _trunk_slots(self) -> dict[str, Slot]:
        slots = {
            "embeddings.word_embeddings.weight": Slot("word_embeddings.weight"),
            **linear_slots("embeddings.LayerNorm", "emb_ln"),
        }
        if self.token_type_embeddings is not None:
            slots["embeddings.token_type_embeddings.weight"] = Slot("token_type_embeddings.weight")
        for i in range(len(self.layers)):
            src, dst = f"encoder.layer.{i}", f"layers.{i}"
            for name, ours in _LAYER_NAMES.items():
                slots.update(linear_slots(f"{src}.{name}", f"{dst}.{ours}"))
            slots[f"{src}.mlp.up_gate_proj.weight"] = Slot(f"{dst}.up_gate_proj.weight")
        return slots

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        x = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_type_ids)
        x = self.emb_ln(x)  # [num_tokens, hidden]
        cos, sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x  # [num_tokens, hidden]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return self.checkpoint_map.load(self, weights)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()


class GteForSequenceClassification(TanhPoolerHead, GteModel):
    """Trunk + pooler (dense + tanh on the CLS token) + ``classifier``, as BERT's head
    (gte-multilingual-reranker-base); the head runs in fp32."""
