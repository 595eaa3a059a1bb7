"""Gemma 3 text models over a flat, unpadded token stream.

``Gemma3ForCausalLM`` generates through the paged KV cache; ``Gemma3TextModel`` is served as an
encoder (EmbeddingGemma: ``use_bidirectional_attention``, no KV cache, pooled by the
sentence-transformers stack of its folder). Both share one trunk, ``Gemma3Model``:

- embeddings scaled by ``sqrt(hidden_size)`` (in the weights' dtype, as transformers);
- per layer ``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``, every norm the
  ``(1 + weight)`` RMSNorm; q/k RMSNorm per head before RoPE; scores scaled by
  ``query_pre_attn_scalar ** -0.5``. ``attn_logit_softcapping`` is read by transformers' Gemma 3
  config but never applied by its attention (Gemma 2's is); cenote matches that and ignores it;
- a gated GELU-tanh MLP (``hidden_activation``);
- ``layer_types``: sliding-window layers (RoPE base ``rope_local_base_freq``) and global layers
  (their own RoPE base and scaling). Causal layers see the ``sliding_window - 1`` keys before
  the query; bidirectional ones (EmbeddingGemma) keys fewer than ``sliding_window // 2 + 1``
  away on either side, as transformers converts the window.

With global layers every KV block is kept; only a model whose layers all slide frees blocks
behind the window. Checkpoint names are Hugging Face's; q/k/v and gate/up load as shards of
fused projections.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from cenote.config import ModelConfig
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention
from cenote.models.layers.linear import TrunkLinear, pack_weight, packed_linear
from cenote.models.layers.norm import GemmaRMSNorm
from cenote.models.layers.rotary import RotaryEmbedding, apply_rotary
from cenote.models.sliding_window import kv_free_window
from cenote.models.weights import copy_weight

logger = logging.getLogger(__name__)

_LAYER_TYPES = ("sliding_attention", "full_attention")
_DEFAULT_SLIDING_PATTERN = 6  # every sixth layer global, as transformers without layer_types


def gemma3_layer_types(config: dict[str, Any]) -> list[str]:
    """``layer_types`` of the config, or (older config.json) every ``sliding_window_pattern``-th
    layer global."""
    num_layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        pattern = int(config.get("sliding_window_pattern", _DEFAULT_SLIDING_PATTERN))
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    unknown = set(types) - set(_LAYER_TYPES)
    if unknown or len(types) != num_layers:
        raise ValueError(
            f"layer_types must name one of {', '.join(_LAYER_TYPES)} for each of the "
            f"{num_layers} layers, got {types}"
        )
    return list(types)


def gemma3_rope_parameters(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """RoPE parameters per layer type: transformers-5 ``rope_parameters`` keyed by layer type,
    or the older ``rope_theta`` + ``rope_scaling`` (global layers) and ``rope_local_base_freq``
    (sliding layers)."""
    params = config.get("rope_parameters") or {}
    if params and all(isinstance(value, dict) for value in params.values()):
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or {})
    else:
        full, sliding = dict(config.get("rope_scaling") or params), {}
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    sliding.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    return {"full_attention": full, "sliding_attention": sliding}


class Gemma3Attention(nn.Module):
    """Fused qkv projection, per-head q/k norm, RoPE, (sliding-window) attention, output proj."""

    def __init__(
        self,
        config: dict[str, Any],
        layer_idx: int,
        window: int | None,
        causal: bool | None,
    ) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(config.get("attention_bias", False))
        self.qkv_proj = TrunkLinear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = TrunkLinear(self.q_size, hidden, bias=bias)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        scalar = config.get("query_pre_attn_scalar") or self.head_dim
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            layer_idx,
            float(scalar) ** -0.5,
            sliding_window=window,
            causal=causal,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).flatten(1)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).flatten(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v.contiguous()))  # [num_tokens, hidden]


class Gemma3MLP(nn.Module):
    """``down(gelu_tanh(gate) * up)`` with a fused gate/up projection, no biases."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, intermediate = config["hidden_size"], config["intermediate_size"]
        self.gate_up_proj = TrunkLinear(hidden, 2 * intermediate, bias=False)
        self.down_proj = TrunkLinear(intermediate, hidden, bias=False)
        self.act = get_activation(config.get("hidden_activation", "gelu_pytorch_tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma3DecoderLayer(nn.Module):
    """``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``."""

    def __init__(
        self, config: dict[str, Any], layer_idx: int, window: int | None, causal: bool | None
    ) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(config, layer_idx, window, causal)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    """The trunk: ``forward(input_ids, positions) -> hidden [num_tokens, hidden]``.

    ``bidirectional``: every query sees its whole request (sliding layers: within the window on
    both sides); needs a step without KV cache. ``causal``: the attention layers' override of the
    step's flag (a causal trunk run as an encoder)."""

    def __init__(self, config: dict[str, Any], bidirectional: bool, causal: bool | None) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        self.embed_scale = hidden**0.5
        self.layer_types = gemma3_layer_types(config)
        window = config.get("sliding_window")
        if window is not None and bidirectional:
            window = int(window) // 2 + 1  # transformers' exclusive bidirectional bound
        self.windows = [
            int(window) if kind == "sliding_attention" and window is not None else None
            for kind in self.layer_types
        ]
        layers = [Gemma3DecoderLayer(config, i, w, causal) for i, w in enumerate(self.windows)]
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(hidden, config.get("rms_norm_eps", 1e-6))
        attention = layers[0].self_attn  # every layer has the same sizes
        self.num_kv_heads: int = attention.num_kv_heads
        self.head_dim: int = attention.head_dim
        self.q_size: int = attention.q_size
        self.kv_size: int = attention.kv_size
        head_dim = self.head_dim
        rope = gemma3_rope_parameters(config)
        self.rotary = {
            kind: RotaryEmbedding(head_dim, {**config, "rope_parameters": rope[kind]})
            for kind in sorted(set(self.layer_types))
        }

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        # the scale is rounded to the weights' dtype first, as transformers does
        x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)
        tables = {  # layer type -> cos, sin [num_tokens, head_dim] in the activation dtype
            kind: tuple(t.to(x.dtype) for t in rotary.cos_sin(positions))
            for kind, rotary in self.rotary.items()
        }
        for kind, layer in zip(self.layer_types, self.layers, strict=True):
            x = layer(x, *tables[kind])
        return self.norm(x)


# checkpoint module -> (our fused module, shard)
_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_FUSED = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


class Gemma3Base(nn.Module):
    """Trunk (``self.model``) + weight loading shared by the causal LM and the encoder.

    ``forward(input_ids [T], positions [T], token_type_ids=None) -> hidden [T, hidden]``.
    """

    is_causal = True

    def __init__(
        self, model_config: ModelConfig, bidirectional: bool = False, causal: bool | None = None
    ) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.model = Gemma3Model(config, bidirectional, causal)
        if config.get("attn_logit_softcapping") is not None:
            logger.info("attn_logit_softcapping is ignored, as transformers' Gemma 3 ignores it")
        trunk = self.model
        self.hidden_size: int = config["hidden_size"]
        self.num_layers = len(trunk.layers)
        self.num_kv_heads = trunk.num_kv_heads
        self.head_dim = trunk.head_dim
        self.kv_sliding_window = kv_free_window(trunk.windows)
        q, kv, intermediate = trunk.q_size, trunk.kv_size, config["intermediate_size"]
        self._shard_rows = {
            "q": (0, q),
            "k": (q, q + kv),
            "v": (q + kv, q + 2 * kv),
            "gate": (0, intermediate),
            "up": (intermediate, 2 * intermediate),
        }

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], 0-based within each request
        token_type_ids: torch.Tensor | None = None,  # unused: Gemma has no token types
    ) -> torch.Tensor:
        return self.model(input_ids, positions)  # [num_tokens, hidden]

    def _checkpoint_name(self, name: str) -> str:
        """Our parameter name for a checkpoint name (before shard mapping)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in; returns the names of our parameters loaded (fused shards
        as ``"<param>[<shard>]"``). Raises on a tensor this model has no place for."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or name.endswith("embed_scale"):
                continue
            if name == "lm_head.weight" and name not in params:
                continue  # tied to the embeddings
            parts = self._checkpoint_name(name).split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in _SHARDS:
                parts[-2], shard = _SHARDS[parts[-2]]
            our_name = ".".join(parts)
            if our_name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            target: torch.Tensor = params[our_name]
            if shard is not None:
                start, end = self._shard_rows[shard]
                target = target[start:end]
            copy_weight(target, tensor, name)
            loaded.add(our_name if shard is None else f"{our_name}[{shard}]")
        return loaded

    def required_parameters(self) -> set[str]:
        names: set[str] = set()
        for name, _ in self.named_parameters():
            module = name.split(".")[-2]
            if module in _FUSED:
                names.update(f"{name}[{shard}]" for shard in _FUSED[module])
            else:
                names.add(name)
        return names


class Gemma3ForCausalLM(Gemma3Base):
    """Gemma 3 text generation: LM head (tied to the embeddings unless configured otherwise),
    logits soft-capped by ``final_logit_softcapping`` when set."""

    def __init__(self, model_config: ModelConfig) -> None:
        config = model_config.hf_config
        if config.get("use_bidirectional_attention"):
            raise ValueError(
                "use_bidirectional_attention is set: the model cannot generate; serve it as "
                "Gemma3TextModel (architectures: ['Gemma3TextModel']) to embed"
            )
        super().__init__(model_config)
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", True))
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(self.hidden_size, config["vocab_size"], bias=False)
        self.final_softcap = config.get("final_logit_softcapping")
        self._lm_head_packed: torch.Tensor | None = None  # set by post_load

    def post_load(self) -> None:
        """Prepack the LM head in the runtime dtype: the costliest matmul of a decode step."""
        self._lm_head_packed = pack_weight(self._lm_head_weight())

    def _lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> fp32 logits ``[N, vocab]``, soft-capped when configured."""
        logits = packed_linear(hidden, self._lm_head_weight(), self._lm_head_packed, None).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3TextModel(Gemma3Base):
    """The Gemma 3 trunk as an encoder (EmbeddingGemma): no KV cache, prompts scheduled whole.

    Bidirectional when the config says ``use_bidirectional_attention``, else causal (each
    layer forces it, as the step of an encoder is not causal). Checkpoint names have no
    ``model.`` prefix (a base model), though a prefixed one loads too."""

    is_causal = False

    def __init__(self, model_config: ModelConfig) -> None:
        bidirectional = bool(model_config.hf_config.get("use_bidirectional_attention"))
        super().__init__(model_config, bidirectional, causal=None if bidirectional else True)

    def _checkpoint_name(self, name: str) -> str:
        return name if name.startswith("model.") else f"model.{name}"
