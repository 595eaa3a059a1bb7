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
from typing import Any

import torch
from torch import nn

from cenote.config import ModelConfig
from cenote.models.checkpoint_map import Slot
from cenote.models.decoder_base import DecoderBase
from cenote.models.layers.decoder import DecoderAttention, GatedMLP
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.lm_head import LMHead
from cenote.models.layers.norm import GemmaRMSNorm
from cenote.models.layers.rotary import RotaryEmbedding

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


class Gemma3DecoderLayer(nn.Module):
    """``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``."""

    def __init__(
        self, config: dict[str, Any], layer_idx: int, window: int | None, causal: bool | None
    ) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = DecoderAttention(
            config,
            layer_idx,
            qkv_bias=bool(config.get("attention_bias", False)),
            o_bias=bool(config.get("attention_bias", False)),
            qk_norm=GemmaRMSNorm,
            query_scalar=config.get("query_pre_attn_scalar"),
            sliding_window=window,
            causal=causal,
        )
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GatedMLP(config, config.get("hidden_activation", "gelu_pytorch_tanh"))
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
        self.embed_tokens = Embedding(config["vocab_size"], hidden)
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
        head_dim = layers[0].self_attn.head_dim  # every layer has the same sizes
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


class Gemma3Base(DecoderBase):
    """Trunk (``self.model``) + weight loading shared by the causal LM and the encoder."""

    model: Gemma3Model

    def __init__(
        self, model_config: ModelConfig, bidirectional: bool = False, causal: bool | None = None
    ) -> None:
        super().__init__(model_config.hf_config)
        config = self.config
        self.model = Gemma3Model(config, bidirectional, causal)
        if config.get("attn_logit_softcapping") is not None:
            logger.info("attn_logit_softcapping is ignored, as transformers' Gemma 3 ignores it")
        attention = self.model.layers[0].self_attn
        assert isinstance(attention, DecoderAttention)
        self._set_sizes(self.model.windows, attention)


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
            self.checkpoint_map = self.checkpoint_map.extended(
                {"lm_head.weight": Slot("lm_head.weight")}
            )
        self.logits_head = LMHead(softcap=config.get("final_logit_softcapping"))

    def post_load(self) -> None:
        self.logits_head.prepare(self._lm_head_module())

    def _lm_head_module(self) -> nn.Module:
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> fp32 logits ``[N, vocab]``, soft-capped when configured."""
        return self.logits_head(hidden, self._lm_head_module())


class Gemma3TextModel(Gemma3Base):
    """The Gemma 3 trunk as an encoder (EmbeddingGemma): no KV cache, prompts scheduled whole.

    Bidirectional when the config says ``use_bidirectional_attention``, else causal (each
    layer forces it, as the step of an encoder is not causal). Checkpoint names have no
    ``model.`` prefix (a base model), though a prefixed one loads too."""

    is_causal = False

    def __init__(self, model_config: ModelConfig) -> None:
        bidirectional = bool(model_config.hf_config.get("use_bidirectional_attention"))
        super().__init__(model_config, bidirectional, causal=None if bidirectional else True)
