"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over a flat, unpadded token stream.

One trunk, ``LlamaModel``, with the variants' differences in ``DecoderOptions``; two heads: a
language-model head (``*ForCausalLM``) and a sequence-classification head
(``*ForSequenceClassification``). Checkpoint names are Hugging Face's; q/k/v and gate/up are
loaded as shards of fused projections. Sliding-window layers (Mistral's ``sliding_window``,
Qwen2's ``use_sliding_window`` / ``max_window_layers``) follow ``models.sliding_window``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cenote.config import ModelConfig
from cenote.models.checkpoint_map import Derived, Slot
from cenote.models.decoder_base import DecoderBase
from cenote.models.interfaces import DecodeStackLayer, DecodeStackSpec, FusedDecode
from cenote.models.layers.activation import SiluAndMul
from cenote.models.layers.decoder import DecoderAttention, GatedMLP
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.lm_head import LMHead
from cenote.models.layers.norm import RMSNorm
from cenote.models.layers.quant import QuantEmbedding, QuantizedWeight, QuantLinear
from cenote.models.layers.rotary import RotaryEmbedding
from cenote.models.sliding_window import layer_windows
from cenote.pooling.activation import Activation
from cenote.pooling.methods import PoolingMethod


@dataclass(frozen=True)
class DecoderOptions:
    """What tells the Llama-family variants apart."""

    qkv_bias: bool  # biases on the q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool  # bias on the attention output projection
    mlp_bias: bool  # biases on gate/up/down
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)

    @classmethod
    def for_variant(cls, variant: str, config: dict[str, Any]) -> DecoderOptions:
        attention_bias = bool(config.get("attention_bias", False))
        if variant == "qwen2":
            return cls(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
        if variant == "qwen3":
            return cls(attention_bias, attention_bias, mlp_bias=False, qk_norm=True)
        return cls(attention_bias, attention_bias, bool(config.get("mlp_bias", False)), False)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(
        self,
        config: dict[str, Any],
        options: DecoderOptions,
        layer_idx: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = DecoderAttention(
            config,
            layer_idx,
            qkv_bias=options.qkv_bias,
            o_bias=options.o_bias,
            qk_norm=RMSNorm if options.qk_norm else None,
            sliding_window=sliding_window,
        )
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = GatedMLP(config, config.get("hidden_act", "silu"), options.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's MLP output (or the embeddings, with ``residual`` None);
        returns this layer's MLP output and the residual stream, whose adds are fused into the
        norms that follow them."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """The decoder trunk: ``forward(input_ids, positions) -> hidden [num_tokens, hidden]``."""

    def __init__(self, config: dict[str, Any], options: DecoderOptions) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config["vocab_size"], config["hidden_size"])
        self.windows = layer_windows(config, config["num_hidden_layers"])  # None: full attention
        layers = [LlamaDecoderLayer(config, options, i, w) for i, w in enumerate(self.windows)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))
        self.rotary = RotaryEmbedding(layers[0].self_attn.head_dim, config)
        self.fused_decode: FusedDecode | None = None  # the runner's, where it gives one

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        # [num_tokens, head_dim] each: computed in fp32, cast once to the activation dtype (as
        # transformers casts them before rotating)
        cos, sin = (t.to(x.dtype) for t in self.rotary.cos_sin(positions))
        if self.fused_decode is not None:
            decoded = self.fused_decode(x, cos, sin)  # a decode step's layers in one call
            if decoded is not None:
                return decoded
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        x, _ = self.norm(x, residual)
        return x

    def decode_stack_spec(self) -> DecodeStackSpec | None:
        """The layers for the runner's fused decode loop, or None where they do not fit it."""
        layers = [layer for layer in self.layers if isinstance(layer, LlamaDecoderLayer)]
        if len(layers) != len(self.layers) or any(
            layer.self_attn.attn.softcap is not None
            or layer.self_attn.q_norm is not None
            or not isinstance(layer.mlp.act_and_mul, SiluAndMul)
            for layer in layers
        ):
            return None
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        first = layers[0].self_attn
        return DecodeStackSpec(
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            first_norm=layers[0].input_layernorm,
            layers=[
                DecodeStackLayer(
                    projections=(
                        layer.self_attn.qkv_proj,
                        layer.self_attn.o_proj,
                        layer.mlp.gate_up_proj,
                        layer.mlp.down_proj,
                    ),
                    post_attention_norm=layer.post_attention_layernorm,
                    next_norm=next_norm,
                    scale=layer.self_attn.attn.scale,
                    cache_index=layer.self_attn.attn.layer_idx,
                )
                for layer, next_norm in zip(layers, norms, strict=True)
            ],
            windows=list(self.windows),
        )


class LlamaDecoder(DecoderBase):
    """Trunk + weight loading shared by the causal-LM and classification models."""

    model: LlamaModel
    variant: ClassVar[str] = "llama"

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config.hf_config)
        config = self.config
        self.model = LlamaModel(config, DecoderOptions.for_variant(self.variant, config))
        attention = self.model.layers[0].self_attn
        assert isinstance(attention, DecoderAttention)
        self._set_sizes(self.model.windows, attention)

    def decode_stack_spec(self) -> DecodeStackSpec | None:
        return self.model.decode_stack_spec()

    def use_fused_decode(self, fused: FusedDecode) -> None:
        self.model.fused_decode = fused

    def prepare_quantized(self, names: set[str]) -> None:
        """Called on the meta device, before weights are allocated: the linear layers and the
        embedding table whose checkpoint tensors all come quantized (``names``, Hugging Face
        names) drop their dense weight; ``load_weights`` collects their ``QuantizedWeight``s and
        ``finish_quantized`` swaps in ``QuantLinear`` / ``QuantEmbedding``."""
        shards: dict[str, set[int | None]] = {}
        for name in names:
            slot = self.checkpoint_map.slot(name)
            if slot is not None and slot.param.endswith(".weight"):
                shards.setdefault(slot.param.removesuffix(".weight"), set()).add(slot.shard)
        self._quantized_parts = {}
        for module_name, got in shards.items():
            module = self.get_submodule(module_name)
            if got == self.weight_shards(module_name) and isinstance(
                module, (nn.Linear, nn.Embedding)
            ):
                del module._parameters["weight"]
                self._quantized_parts[module_name] = {}

    def finish_quantized(self, dtype: torch.dtype) -> None:
        """Swap the modules ``prepare_quantized`` emptied for their quantized versions."""
        for module_name, parts in self._quantized_parts.items():
            parent_name, _, child = module_name.rpartition(".")
            parent = self.get_submodule(parent_name) if parent_name else self
            module = getattr(parent, child)
            order = sorted(self.weight_shards(module_name), key=lambda shard: shard or 0)
            if set(parts) != set(order):
                raise ValueError(f"{module_name}: checkpoint lacks quantized shards of it")
            if isinstance(module, nn.Embedding):
                replacement: nn.Module = QuantEmbedding(parts[None], dtype)
            else:
                bias = module.bias.to(dtype) if module.bias is not None else None
                replacement = QuantLinear([parts[shard] for shard in order], bias)
            setattr(parent, child, replacement)
        self._quantized_parts = {}


class LlamaForCausalLM(LlamaDecoder):
    """Llama / Mistral with a language-model head (tied to the embeddings when configured)."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self.tie_word_embeddings = bool(self.config.get("tie_word_embeddings", False))
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(self.hidden_size, self.config["vocab_size"], bias=False)
            self.checkpoint_map = self.checkpoint_map.extended(
                {"lm_head.weight": Slot("lm_head.weight")}
            )
        self.logits_head = LMHead()

    def post_load(self) -> None:
        self.logits_head.prepare(self._lm_head_module())

    def _lm_head_module(self) -> nn.Module:
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> fp32 logits ``[N, vocab]`` (matmul in the model dtype)."""
        return self.logits_head(hidden, self._lm_head_module())


class Qwen2ForCausalLM(LlamaForCausalLM):
    variant = "qwen2"


class Qwen3ForCausalLM(LlamaForCausalLM):
    variant = "qwen3"


class LlamaForSequenceClassification(LlamaDecoder):
    """The trunk with a bias-free ``score`` head; the pooler picks each request's last token.

    Converted from a causal LM with ``classifier_from_token`` (e.g. ``["no", "yes"]``), the head
    is built from those LM-head rows: one row per token, or, with
    ``is_original_qwen3_reranker``, the single row ``w_yes - w_no`` so that
    ``sigmoid(score) = sigmoid(logit_yes - logit_no)`` (Qwen3-Reranker).
    """

    classifier_pooling: PoolingMethod | None = "last"  # the head reads the last token
    head_modules: tuple[str, ...] = ("score",)  # ``ReplaceableHead``
    default_activation: Activation | None = None  # from the config
    step_tag_id: int | None = None

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        tokens = self.config.get("classifier_from_token")
        self.from_token_ids: list[int] | None = None
        self.two_way = bool(self.config.get("is_original_qwen3_reranker")) or (
            self.config.get("method") == "from_2_way_softmax"
        )
        if tokens:
            self.from_token_ids = _token_ids(model_config, list(tokens))
            if self.two_way and len(tokens) != 2:
                raise ValueError(
                    f"is_original_qwen3_reranker needs 2 classifier_from_token entries "
                    f"(false, true), got {len(tokens)}: {tokens}"
                )
            self.num_labels = 1 if self.two_way else len(tokens)
        else:
            labels = self.config.get("id2label")
            self.num_labels = len(labels) if labels else int(self.config.get("num_labels", 2))
        self.score = nn.Linear(self.hidden_size, self.num_labels, bias=False)
        if self.from_token_ids is None:
            head_slots = {"score.weight": Slot("score.weight")}
            self.checkpoint_map = self.checkpoint_map.extended(head_slots)
        else:
            sources = ("lm_head.weight", "embed_tokens.weight")
            derived = Derived("score.weight", sources, self._score_from_tokens)
            self.checkpoint_map = self.checkpoint_map.extended(derived=(derived,))

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> fp32 scores ``[N, num_labels]`` (the head runs in fp32)."""
        return F.linear(hidden.float(), self.score.weight.float())

    def _score_from_tokens(self, sources: dict[str, Any]) -> torch.Tensor:
        """The head from the LM-head rows of ``classifier_from_token`` (``Derived``)."""
        lm_head = sources.get("lm_head.weight", sources.get("embed_tokens.weight"))
        if lm_head is None:
            raise ValueError("classifier_from_token needs lm_head.weight or tied embeddings")
        if isinstance(lm_head, QuantizedWeight):
            lm_head = lm_head.dequantize()
        rows = lm_head[self.from_token_ids].float()  # [num_tokens, hidden]
        return (rows[1] - rows[0]).unsqueeze(0) if self.two_way else rows


def _token_ids(model_config: ModelConfig, tokens: list[str]) -> list[int]:
    """Vocabulary ids of ``classifier_from_token`` entries (each must be a single token)."""
    from cenote.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_config)
    ids = []
    for token in tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            encoded = tokenizer.encode(token, add_special_tokens=False).ids
            if len(encoded) != 1:
                raise ValueError(
                    f"classifier_from_token entry {token!r} is {len(encoded)} tokens, not one"
                )
            token_id = encoded[0]
        ids.append(token_id)
    return ids


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    variant = "qwen2"


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    variant = "qwen3"
