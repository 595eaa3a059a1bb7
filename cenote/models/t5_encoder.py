"""T5 / mT5 encoder stacks (sentence-t5, GTR) over a flat, unpadded token stream.

Pre-norm layers with RMS norms and no biases; attention is unscaled and adds a learned bias per
head and bucket of relative position (bidirectional buckets: exact for small distances,
logarithmic up to ``relative_attention_max_distance``), held by the first layer and shared by
all. The MLP is ``wo(act(wi x))`` or, for ``gated-*`` projections, ``wo(act(wi_0 x) * wi_1 x)``.
sentence-transformers puts mean pooling and a Dense projection after it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.models.checkpoint_map import CheckpointMap, Slot, load_checkpoint
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention, EncoderMaskFn
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import TrunkLinear
from cenote.models.layers.norm import RMSNorm
from cenote.models.layers.relative_position import RelativePositionBias


def feed_forward(config: dict[str, Any]) -> tuple[str, bool]:
    """(activation name, gated) from ``feed_forward_proj`` (``relu``, ``gated-gelu``...)."""
    projection = config.get("feed_forward_proj", "relu")
    parts = projection.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ValueError(
            f"T5 feed_forward_proj {projection!r} is not supported; supported: ACT or gated-ACT"
        )
    name = parts[-1]
    if projection == "gated-gelu":
        name = "gelu_new"  # as transformers' T5Config
    get_activation(name)  # refuses an unknown activation with the supported list
    return name, len(parts) == 2


class T5Layer(nn.Module):
    """``x + o(attn(norm(x)))`` then ``x + wo(mlp(norm(x)))``."""

    def __init__(self, config: dict[str, Any], layer_idx: int) -> None:
        super().__init__()
        d_model, heads, d_kv = config["d_model"], config["num_heads"], config["d_kv"]
        d_ff, eps = config["d_ff"], config.get("layer_norm_epsilon", 1e-6)
        inner = heads * d_kv
        self.attn_norm = RMSNorm(d_model, eps)
        self.qkv = TrunkLinear(d_model, 3 * inner, bias=False)
        self.attn = Attention(heads, d_kv, heads, layer_idx, 1.0)  # T5 does not scale scores
        self.o = TrunkLinear(inner, d_model, bias=False)
        self.mlp_norm = RMSNorm(d_model, eps)
        name, self.gated = feed_forward(config)
        self.act = get_activation(name)
        self.wi = TrunkLinear(d_model, 2 * d_ff if self.gated else d_ff, bias=False)
        self.wo = TrunkLinear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor, mask_fn: EncoderMaskFn) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        x = x + self.o(self.attn(q, k, v, mask_fn))
        h = self.wi(self.mlp_norm(x))
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return x + self.wo(h)


# checkpoint module (after ``encoder.block.N.``) -> (ours, shard of a stacked weight)
_LAYER_NAMES: dict[str, tuple[str, int | None]] = {
    "layer.0.layer_norm": ("attn_norm", None),
    "layer.0.SelfAttention.q": ("qkv", 0),
    "layer.0.SelfAttention.k": ("qkv", 1),
    "layer.0.SelfAttention.v": ("qkv", 2),
    "layer.0.SelfAttention.o": ("o", None),
    "layer.1.layer_norm": ("mlp_norm", None),
    "layer.1.DenseReluDense.wi": ("wi", None),
    "layer.1.DenseReluDense.wi_0": ("wi", 0),
    "layer.1.DenseReluDense.wi_1": ("wi", 1),
    "layer.1.DenseReluDense.wo": ("wo", None),
}


class T5EncoderModel(nn.Module):
    """``forward(input_ids, positions) -> hidden_states [num_tokens, d_model]`` (after the final
    norm, as transformers' ``last_hidden_state``)."""

    is_causal = False

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.hidden_size = config["d_model"]
        num_buckets = int(config.get("relative_attention_num_buckets", 32))
        max_distance = int(config.get("relative_attention_max_distance", 128))
        self.embed_tokens = Embedding(config["vocab_size"], self.hidden_size)
        self.relative_attention_bias = RelativePositionBias(
            num_buckets, config["num_heads"], num_buckets, max_distance
        )
        self.layers = nn.ModuleList(T5Layer(config, i) for i in range(config["num_layers"]))
        self.final_layer_norm = RMSNorm(self.hidden_size, config.get("layer_norm_epsilon", 1e-6))
        self.checkpoint_map = self._checkpoint_map()

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        # positions unused (they enter as relative bias); token_type_ids unused: T5 has none
        x = self.embed_tokens(input_ids)
        mask_fn = self.relative_attention_bias.mask_fn(x.dtype)  # the same for every layer
        for layer in self.layers:
            x = layer(x, mask_fn)
        return self.final_layer_norm(x)  # [num_tokens, d_model]

    def _checkpoint_map(self) -> CheckpointMap:
        """Checkpoint q/k/v (and gated wi_0/wi_1) fill row blocks of our stacked weights; the
        relative-position table lives in the first block."""
        slots = {
            "shared.weight": Slot("embed_tokens.weight"),
            "encoder.embed_tokens.weight": Slot("embed_tokens.weight"),  # a copy of shared
            "encoder.final_layer_norm.weight": Slot("final_layer_norm.weight"),
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": Slot(
                "relative_attention_bias.weight"
            ),
        }
        _, gated = feed_forward(self.config)
        other_kind = (
            ("DenseReluDense.wi",) if gated else ("DenseReluDense.wi_0", "DenseReluDense.wi_1")
        )
        for i in range(len(self.layers)):
            for module, (ours, shard) in _LAYER_NAMES.items():
                if module.endswith(other_kind):
                    continue  # the other MLP kind's input projections
                num_shards = {"qkv": 3, "wi": 2}.get(ours, 1) if shard is not None else 1
                slot = Slot(f"layers.{i}.{ours}.weight", shard, num_shards)
                slots[f"encoder.block.{i}.{module}.weight"] = slot
        # the decoder stack and LM head of a full T5 checkpoint
        return CheckpointMap(slots, unused=(r"decoder\.", r"lm_head\."))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, self.checkpoint_map, weights)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()
