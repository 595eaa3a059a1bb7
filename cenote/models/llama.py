"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over a flat, unpadded token stream.

One trunk, ``LlamaModel``, with the variants' differences in ``DecoderOptions``; two heads: a
language-model head (``*ForCausalLM``) and a sequence-classification head
(``*ForSequenceClassification``). Checkpoint names are Hugging Face's; q/k/v and gate/up are
loaded as shards of fused projections. Sliding-window layers (Mistral's ``sliding_window``,
Qwen2's ``use_sliding_window`` / ``max_window_layers``) follow ``models.sliding_window``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cenote.config import ModelConfig
from cenote.kernels import quant_ops
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention
from cenote.models.layers.linear import TrunkLinear, pack_weight, packed_linear
from cenote.models.layers.norm import RMSNorm
from cenote.models.layers.quant import QuantEmbedding, QuantizedWeight, QuantLinear, quant_linear
from cenote.models.layers.rotary import RotaryEmbedding, apply_rotary
from cenote.models.sliding_window import kv_free_window, layer_windows
from cenote.models.weights import copy_weight
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


class LlamaAttention(nn.Module):
    """Fused qkv projection, optional per-head q/k norm, RoPE, paged attention, output proj."""

    def __init__(
        self,
        config: dict[str, Any],
        options: DecoderOptions,
        layer_idx: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = TrunkLinear(hidden, self.q_size + 2 * self.kv_size, bias=options.qkv_bias)
        self.o_proj = TrunkLinear(self.q_size, hidden, bias=options.o_bias)
        self.q_norm = self.k_norm = None
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.get("rms_norm_eps", 1e-6))
            self.k_norm = RMSNorm(self.head_dim, config.get("rms_norm_eps", 1e-6))
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            layer_idx,
            self.head_dim**-0.5,
            sliding_window=sliding_window,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).flatten(1)
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).flatten(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v.contiguous()))  # [num_tokens, hidden]


class LlamaMLP(nn.Module):
    """Gated MLP with a fused gate/up projection: ``down(act(gate) * up)``."""

    def __init__(self, config: dict[str, Any], options: DecoderOptions) -> None:
        super().__init__()
        hidden, intermediate = config["hidden_size"], config["intermediate_size"]
        self.gate_up_proj = TrunkLinear(hidden, 2 * intermediate, bias=options.mlp_bias)
        self.down_proj = TrunkLinear(intermediate, hidden, bias=options.mlp_bias)
        self.act = get_activation(config.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


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
        self.self_attn = LlamaAttention(config, options, layer_idx, sliding_window)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = LlamaMLP(config, options)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder trunk: ``forward(input_ids, positions) -> hidden [num_tokens, hidden]``."""

    def __init__(self, config: dict[str, Any], options: DecoderOptions) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.windows = layer_windows(config, config["num_hidden_layers"])  # None: full attention
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, options, i, window) for i, window in enumerate(self.windows)
        )
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))
        self.rotary = RotaryEmbedding(self.layers[0].self_attn.head_dim, config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        # [num_tokens, head_dim] each: computed in fp32, cast once to the activation dtype (as
        # transformers casts them before rotating)
        cos, sin = (t.to(x.dtype) for t in self.rotary.cos_sin(positions))
        ops = quant_ops()
        if ops is not None and x.dtype in (torch.float32, torch.bfloat16) and self._fusable():
            return self._forward_fused(ops, x, cos, sin)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def _fusable(self) -> bool:
        """Every layer's steps have a fused kernel: SiLU MLPs, RoPE without q/k norms."""
        return all(
            layer.self_attn.q_norm is None and layer.mlp.act is F.silu for layer in self.layers
        )

    def _forward_fused(
        self, ops: ModuleType, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The same layers with their elementwise steps fused (cenote/kernels/fused_ops.cpp):
        each residual add is fused with the norm after it, across layer boundaries, and RoPE
        rotates q and k in place; every op rounds as the torch code above does."""
        residual = residual.contiguous()
        hidden = residual.clone()
        first = self.layers[0].input_layernorm
        ops.add_rms_norm_(hidden, None, first.weight, first.eps)
        for i, layer in enumerate(self.layers):
            attention = layer.self_attn
            qkv = attention.qkv_proj(hidden)
            q_end = attention.q_size
            k_end = q_end + attention.kv_size
            ops.rotary_(qkv, cos, sin, k_end)
            out = attention.o_proj(
                attention.attn(
                    qkv[:, :q_end].contiguous(),
                    qkv[:, q_end:k_end].contiguous(),
                    qkv[:, k_end:].contiguous(),
                )
            )
            norm = layer.post_attention_layernorm
            ops.add_rms_norm_(out, residual, norm.weight, norm.eps)  # residual += attention
            mlp = layer.mlp
            hidden = mlp.down_proj(ops.silu_and_mul(mlp.gate_up_proj(out)))
            norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            ops.add_rms_norm_(hidden, residual, norm.weight, norm.eps)  # residual += mlp
        return hidden


# checkpoint module -> (our fused module, shard)
_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_FUSED = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


class LlamaDecoder(nn.Module):
    """Trunk + weight loading shared by the causal-LM and classification models.

    ``forward(input_ids [T], positions [T], token_type_ids=None) -> hidden [T, hidden]`` (final
    norm applied). ``num_layers``, ``num_kv_heads`` and ``head_dim`` size the KV cache;
    ``kv_sliding_window`` (set when every layer slides) lets it free blocks behind the window.
    """

    is_causal = True
    variant: ClassVar[str] = "llama"

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.model = LlamaModel(config, DecoderOptions.for_variant(self.variant, config))
        self.kv_sliding_window = kv_free_window(self.model.windows)
        attention = self.model.layers[0].self_attn
        self.hidden_size = config["hidden_size"]
        self.num_layers = len(self.model.layers)
        self.num_kv_heads = attention.num_kv_heads
        self.head_dim = attention.head_dim
        q, kv, intermediate = attention.q_size, attention.kv_size, config["intermediate_size"]
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
        token_type_ids: torch.Tensor | None = None,  # unused: decoders have no token types
    ) -> torch.Tensor:
        return self.model(input_ids, positions)  # [num_tokens, hidden]

    def prepare_quantized(self, names: set[str]) -> None:
        """Called on the meta device, before weights are allocated: the linear layers and the
        embedding table whose checkpoint tensors all come quantized (``names``, Hugging Face
        names) drop their dense weight; ``load_weights`` collects their ``QuantizedWeight``s and
        ``finish_quantized`` swaps in ``QuantLinear`` / ``QuantEmbedding``."""
        shards: dict[str, set[str | None]] = {}
        for name in names:
            our_name, shard = self._map_name(name)
            module_name, _, leaf = our_name.rpartition(".")
            if leaf == "weight":
                shards.setdefault(module_name, set()).add(shard)
        self._quantized_parts: dict[str, dict[str | None, QuantizedWeight]] = {}
        for module_name, got in shards.items():
            try:
                module = self.get_submodule(module_name)
            except AttributeError:
                continue  # e.g. an lm_head this model does not have
            expected = set(_FUSED.get(module_name.rsplit(".", 1)[-1], (None,)))
            if got == expected and isinstance(module, (nn.Linear, nn.Embedding)):
                del module._parameters["weight"]
                self._quantized_parts[module_name] = {}

    def finish_quantized(self, dtype: torch.dtype) -> None:
        """Swap the modules ``prepare_quantized`` emptied for their quantized versions."""
        for module_name, parts in getattr(self, "_quantized_parts", {}).items():
            parent_name, _, child = module_name.rpartition(".")
            parent = self.get_submodule(parent_name) if parent_name else self
            module = getattr(parent, child)
            order = _FUSED.get(child, (None,))
            if set(parts) != set(order):
                raise ValueError(f"{module_name}: checkpoint lacks quantized shards of it")
            if isinstance(module, nn.Embedding):
                replacement: nn.Module = QuantEmbedding(parts[None], dtype)
            else:
                bias = module.bias.to(dtype) if module.bias is not None else None
                replacement = QuantLinear([parts[shard] for shard in order], bias)
            setattr(parent, child, replacement)
        self._quantized_parts = {}

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
    ) -> set[str]:
        """Copy checkpoint tensors into the module; returns the names of our parameters loaded.

        Fused shards are reported as ``"<param>[<shard>]"``. Raises on a checkpoint tensor this
        model has no place for (other than RoPE buffers and an unused ``lm_head``).
        ``QuantizedWeight``s go to the modules ``prepare_quantized`` chose.
        """
        params = dict(self.named_parameters())
        quantized = getattr(self, "_quantized_parts", {})
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            our_name, shard = self._map_name(name)
            module_name = our_name.rpartition(".")[0]
            if isinstance(tensor, QuantizedWeight):
                if module_name not in quantized:
                    if name == "lm_head.weight":
                        continue
                    raise ValueError(f"quantized tensor {name!r} has no quantized place here")
                quantized[module_name][shard] = tensor
                continue
            if name == "lm_head.weight" and name not in params:
                continue  # tied embeddings, or a classifier converted from a causal LM
            if our_name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            target = params[our_name]
            if shard is not None:
                start, end = self._shard_rows[shard]
                target = target[start:end]
            copy_weight(target, tensor, name)
            loaded.add(our_name if shard is None else f"{our_name}[{shard}]")
        return loaded

    @staticmethod
    def _map_name(name: str) -> tuple[str, str | None]:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _SHARDS:
            fused, shard = _SHARDS[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return name, None

    def required_parameters(self) -> set[str]:
        names: set[str] = set()
        for name, _ in self.named_parameters():
            module = name.split(".")[-2]
            if module in _FUSED:
                names.update(f"{name}[{shard}]" for shard in _FUSED[module])
            else:
                names.add(name)
        return names


class LlamaForCausalLM(LlamaDecoder):
    """Llama / Mistral with a language-model head (tied to the embeddings when configured)."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self.tie_word_embeddings = bool(self.config.get("tie_word_embeddings", False))
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(self.hidden_size, self.config["vocab_size"], bias=False)

    def post_load(self) -> None:
        """Prepack the LM head (tied or not) in the runtime dtype: the costliest matmul of a
        decode step. A quantized head stays quantized."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        self._lm_head_quantized: QuantizedWeight | None = None
        self._lm_head_packed = None
        if isinstance(head, QuantEmbedding):
            self._lm_head_quantized = head.weight_q
        elif isinstance(head, QuantLinear) and len(head.parts) == 1:
            self._lm_head_quantized = head.parts[0]
        elif not isinstance(head, QuantLinear):
            self._lm_head_packed = pack_weight(self._lm_head_weight())

    def _lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> fp32 logits ``[N, vocab]`` (matmul in the model dtype)."""
        quantized = getattr(self, "_lm_head_quantized", None)
        if quantized is not None:
            return quant_linear(hidden, quantized, None).float()
        if isinstance(self.lm_head, QuantLinear):
            return self.lm_head(hidden).float()
        packed = getattr(self, "_lm_head_packed", None)
        return packed_linear(hidden, self._lm_head_weight(), packed, None).float()


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

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> fp32 scores ``[N, num_labels]`` (the head runs in fp32)."""
        return F.linear(hidden.float(), self.score.weight.float())

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
    ) -> set[str]:
        if self.from_token_ids is None:
            return super().load_weights(weights)
        sources: dict[str, torch.Tensor] = {}

        def trunk_weights() -> Iterable[tuple[str, torch.Tensor | QuantizedWeight]]:
            for name, tensor in weights:
                if name in ("lm_head.weight", "model.embed_tokens.weight"):
                    sources[name] = (
                        tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor
                    )
                if name != "lm_head.weight":
                    yield name, tensor

        loaded = super().load_weights(trunk_weights())
        lm_head = sources.get("lm_head.weight", sources.get("model.embed_tokens.weight"))
        if lm_head is None:
            raise ValueError("classifier_from_token needs lm_head.weight or tied embeddings")
        rows = lm_head[self.from_token_ids].float()  # [num_tokens, hidden]
        weight = (rows[1] - rows[0]).unsqueeze(0) if self.two_way else rows
        with torch.no_grad():
            self.score.weight.copy_(weight)
        loaded.add("score.weight")
        return loaded


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
