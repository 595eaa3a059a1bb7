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
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from cenote.config import ModelConfig
from cenote.forward_context import get_attention_metadata
from cenote.kernels import DecodeStack, ops
from cenote.models.decoder_base import FUSED, DecoderBase, map_name
from cenote.models.layers.attention_plan import paged_plan
from cenote.models.layers.decoder import DecoderAttention, GatedMLP
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import TrunkLinear, pack_weight, packed_linear
from cenote.models.layers.lora import active_lora_batch
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self._decode_stack: DecodeStack | None | Literal[False] = False  # False: not built yet
        self._stack_max_rows = 0.0
        self._all_fusable: bool | None = None  # _fusable(), once asked

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        # [num_tokens, head_dim] each: computed in fp32, cast once to the activation dtype (as
        # transformers casts them before rotating)
        cos, sin = (t.to(x.dtype) for t in self.rotary.cos_sin(positions))
        if self._fusable():
            return self._forward_fused(x, cos, sin)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def _fusable(self) -> bool:
        """Every layer's steps have a fused kernel: SiLU MLPs, RoPE without q/k norms (what the
        layers are built with, so asked once, not every step)."""
        if self._all_fusable is None:
            self._all_fusable = all(
                isinstance(layer, LlamaDecoderLayer)  # nn.ModuleList types its items as Module
                and layer.self_attn.q_norm is None
                and layer.mlp.act is F.silu
                for layer in self.layers
            )
        return self._all_fusable

    def _forward_fused(
        self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The same layers with their elementwise steps fused (cenote/kernels/fused_ops.cpp):
        each residual add is fused with the norm after it, across layer boundaries, and RoPE
        rotates q and k in place; every op rounds as the torch code above does."""
        residual = residual.contiguous()
        hidden = residual.clone()
        first = self.layers[0].input_layernorm
        assert isinstance(first, RMSNorm)
        ops.add_rms_norm_(hidden, None, first.weight, first.eps)
        decoded = self._decode_step(residual, hidden, cos, sin)
        if decoded is not None:
            return decoded
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)  # nn.ModuleList types its items as Module
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
            next_norm = (
                self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            )
            assert isinstance(next_norm, RMSNorm)
            ops.add_rms_norm_(hidden, residual, next_norm.weight, next_norm.eps)  # residual += mlp
        return hidden

    def _decode_step(
        self,
        residual: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor | None:
        """The layer loop of ``_forward_fused`` as one C++ call (cenote/kernels/
        decode_stack.cpp, bit-identical) when every row is one new token of its request and
        every projection has a weight the stack multiplies at this many rows, and no row has a
        LoRA adapter (the stack reads the base weights only); else None."""
        if active_lora_batch() is not None or hidden.device.type != "cpu":
            return None  # the stack reads the base weights only, through host pointers
        metadata = get_attention_metadata()
        if metadata.kv_caches is None or metadata.slot_mapping is None:
            return None
        stack = self._stack()
        if stack is None or hidden.shape[0] > self._stack_max_rows:
            return None
        plans = [paged_plan(metadata, window) for window in self.windows]
        if not plans[0].all_decode or hidden.dtype != metadata.kv_caches[0].dtype:
            return None
        tables, starts, ends = [], [], []
        for plan in plans:
            assert plan.decode_tables is not None and plan.decode_starts is not None
            assert plan.decode_ends is not None  # all-decode plans have all three
            tables.append(plan.decode_tables)
            starts.append(plan.decode_starts)
            ends.append(plan.decode_ends)
        return stack.run(
            residual,
            hidden,
            cos,
            sin,
            metadata.kv_caches,
            metadata.slot_mapping,
            tables,
            starts,
            ends,
        )

    def _stack(self) -> DecodeStack | None:
        """The layers as a ``DecodeStack``, built on first use (the weights are final by then),
        or None where a layer does not fit it (a dense or split projection, attention kernels
        unavailable, a softcap)."""
        if self._decode_stack is not False:
            return self._decode_stack
        self._decode_stack = None
        layers = [layer for layer in self.layers if isinstance(layer, LlamaDecoderLayer)]
        modules: list[nn.Module] = [
            module
            for layer in layers
            for module in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        ]
        specs = [_stack_linear(module) for module in modules]
        if len(layers) != len(self.layers) or any(spec is None for spec in specs):
            return None
        if any(layer.self_attn.attn.softcap is not None for layer in layers):
            return None
        first = layers[0].self_attn
        stack = ops.decode_stack(first.num_heads, first.num_kv_heads, first.head_dim)
        if stack is None:
            return None
        for i, layer in enumerate(layers):
            for spec in specs[4 * i : 4 * i + 4]:  # qkv, o, gate_up, down
                assert spec is not None
                stack.add_linear(*spec[0])
            post = layer.post_attention_layernorm
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            attn = layer.self_attn.attn
            stack.add_layer(
                post.weight, post.eps, following.weight, following.eps, attn.scale, attn.layer_idx
            )
        self._stack_max_rows = min(spec[1] for spec in specs if spec is not None)
        self._decode_stack = stack
        return stack


_StackLinear = tuple[
    torch.Tensor | None,  # q
    torch.Tensor | None,  # scale
    torch.Tensor | None,  # mn
    int,  # bits
    int,  # group
    int,  # fused_max_rows
    int,  # dot_max_rows
    torch.Tensor | None,  # packed
    torch.dtype,  # dense_dtype
    torch.Tensor | None,  # bias
]


def _stack_linear(module: nn.Module) -> tuple[_StackLinear, float] | None:
    """``DecodeStack.add_linear``'s arguments for a projection and the most rows the stack can
    multiply it at, as its module would (QuantLinear: the fused kernel, then its dense copy;
    TrunkLinear: its prepacked weight), or None where the stack cannot."""
    if isinstance(module, QuantLinear) and len(module.parts) == 1:
        part, packed = module.parts[0], module.dense_packed
        dense_dtype = module.dense_dtype or torch.float32
        rows = float("inf") if packed is not None else module.fused_max_rows
        args = (part.qdata, part.scales, part.mins, part.bits, part.group, module.fused_max_rows)
        rows = max(rows, module.dot_max_rows)
        return (*args, module.dot_max_rows, packed, dense_dtype, module.bias), rows
    if isinstance(module, TrunkLinear) and module.packed is not None:
        spec = (None, None, None, 0, 0, 0, 0, module.packed, module.weight.dtype, module.bias)
        return spec, float("inf")
    return None


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

    def prepare_quantized(self, names: set[str]) -> None:
        """Called on the meta device, before weights are allocated: the linear layers and the
        embedding table whose checkpoint tensors all come quantized (``names``, Hugging Face
        names) drop their dense weight; ``load_weights`` collects their ``QuantizedWeight``s and
        ``finish_quantized`` swaps in ``QuantLinear`` / ``QuantEmbedding``."""
        shards: dict[str, set[str | None]] = {}
        for name in names:
            our_name, shard = map_name(name)
            module_name, _, leaf = our_name.rpartition(".")
            if leaf == "weight":
                shards.setdefault(module_name, set()).add(shard)
        self._quantized_parts = {}
        for module_name, got in shards.items():
            try:
                module = self.get_submodule(module_name)
            except AttributeError:
                continue  # e.g. an lm_head this model does not have
            expected = set(FUSED.get(module_name.rsplit(".", 1)[-1], (None,)))
            if got == expected and isinstance(module, (nn.Linear, nn.Embedding)):
                del module._parameters["weight"]
                self._quantized_parts[module_name] = {}

    def finish_quantized(self, dtype: torch.dtype) -> None:
        """Swap the modules ``prepare_quantized`` emptied for their quantized versions."""
        for module_name, parts in self._quantized_parts.items():
            parent_name, _, child = module_name.rpartition(".")
            parent = self.get_submodule(parent_name) if parent_name else self
            module = getattr(parent, child)
            order = FUSED.get(child, (None,))
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

    def post_load(self) -> None:
        """Prepack the LM head (tied or not) in the runtime dtype: the costliest matmul of a
        decode step. A quantized head stays quantized (a tied quantized table multiplies as a
        ``QuantLinear`` over the same bytes)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        self._quant_head: QuantLinear | None = None
        self._lm_head_packed = None
        if isinstance(head, QuantEmbedding):
            self._quant_head = QuantLinear([head.weight_q], None)
        elif isinstance(head, QuantLinear):
            self._quant_head = head
        else:
            self._lm_head_packed = pack_weight(self._lm_head_weight())

    def _lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> fp32 logits ``[N, vocab]`` (matmul in the model dtype)."""
        quant_head = getattr(self, "_quant_head", None)
        if quant_head is not None:
            return quant_head(hidden).float()
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
