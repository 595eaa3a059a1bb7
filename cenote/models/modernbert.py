"""ModernBERT encoder (and its sequence-classification head) over a flat, unpadded token stream.

Pre-norm layers (the first without an attention norm), fused QKV with rotary embeddings, GeGLU
MLP, no position or token-type embeddings. Layers alternate global attention and local attention
over a window of ``local_attention`` tokens (a token sees those at most ``local_attention // 2``
away), each kind with its own rotary base. Norm and linear biases follow the config
(``norm_bias``, ``attention_bias``, ``mlp_bias``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.models.bert_classifiers import num_labels_of
from cenote.models.checkpoint_map import CheckpointMap, Slot, linear_slots, load_checkpoint
from cenote.models.interfaces import ScorerDefaults
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention, EncoderMaskFn
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import TrunkLinear, linear_fp32
from cenote.models.layers.rotary import RotaryEmbedding, apply_rotary
from cenote.pooling.methods import PoolingMethod

LAYER_TYPES = ("full_attention", "sliding_attention")
_DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}
_OLD_THETA_KEYS = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}
CLASSIFIER_POOLING = ("cls", "mean")


def layer_types(config: dict[str, Any]) -> list[str]:
    """Per layer: ``full_attention`` or ``sliding_attention`` (``layer_types``, else the older
    ``global_attn_every_n_layers``: every n-th layer from the first is global)."""
    num_layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        every = int(config.get("global_attn_every_n_layers", 3))
        types = ["sliding_attention" if i % every else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != num_layers:
        raise ValueError(
            f"ModernBERT layer_types {types} are not supported: need {num_layers} entries, each "
            f"one of {', '.join(LAYER_TYPES)}"
        )
    return list(types)


def rope_config(config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """The rotary settings of one layer kind, as ``RotaryEmbedding`` reads them: the
    transformers-5 per-kind ``rope_parameters``, else ``global_rope_theta`` / ``local_rope_theta``."""
    params = dict((config.get("rope_parameters") or {}).get(layer_type) or {})
    params.setdefault(
        "rope_theta", config.get(_OLD_THETA_KEYS[layer_type], _DEFAULT_THETA[layer_type])
    )
    return {
        "rope_parameters": params,
        "max_position_embeddings": config.get("max_position_embeddings"),
    }


def _layer_norm(config: dict[str, Any]) -> nn.LayerNorm:
    return nn.LayerNorm(
        config["hidden_size"],
        eps=config.get("norm_eps", 1e-5),
        bias=bool(config.get("norm_bias", False)),
    )


class ModernBertLayer(nn.Module):
    """``x + attn(attn_norm(x))`` then ``x + Wo(act(input) * gate)`` over ``mlp_norm(x)``."""

    def __init__(self, config: dict[str, Any], layer_idx: int, sliding: bool) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.head_dim = hidden // heads
        attention_bias = bool(config.get("attention_bias", False))
        mlp_bias = bool(config.get("mlp_bias", False))
        self.attn_norm = _layer_norm(config) if layer_idx > 0 else nn.Identity()
        self.Wqkv = TrunkLinear(hidden, 3 * hidden, bias=attention_bias)
        self.attn = Attention(heads, self.head_dim, heads, layer_idx, self.head_dim**-0.5)
        self.Wo = TrunkLinear(hidden, hidden, bias=attention_bias)
        self.mlp_norm = _layer_norm(config)
        self.Wi = TrunkLinear(hidden, 2 * config["intermediate_size"], bias=mlp_bias)
        self.act = get_activation(config.get("hidden_activation", "gelu"))
        self.mlp_out = TrunkLinear(config["intermediate_size"], hidden, bias=mlp_bias)
        self.sliding = sliding

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        mask_fn: EncoderMaskFn | None,
    ) -> torch.Tensor:
        q, k, v = self.Wqkv(self.attn_norm(x)).chunk(3, dim=-1)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        x = x + self.Wo(self.attn(q, k, v, mask_fn))
        up, gate = self.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp_out(self.act(up) * gate)


def window_mask_fn(half_window: int) -> EncoderMaskFn:
    """Local attention: token i sees token j when ``|i - j| <= half_window``; None (no mask)
    for requests short enough that every token is inside every window."""
    masks: dict[int, torch.Tensor] = {}

    def mask_fn(rows: slice, num_requests: int, length: int) -> torch.Tensor | None:
        if length - 1 <= half_window:
            return None
        if length not in masks:
            index = torch.arange(length)
            masks[length] = (index[:, None] - index[None, :]).abs() <= half_window
        return masks[length]  # [length, length] bool, broadcast over requests and heads

    return mask_fn


def both_masks(first: EncoderMaskFn, second: EncoderMaskFn | None) -> EncoderMaskFn:
    """Boolean masks of ``first`` and ``second`` together: a key is seen when both let it."""
    if second is None:
        return first

    def mask_fn(rows: slice, num_requests: int, length: int) -> torch.Tensor | None:
        a, b = first(rows, num_requests, length), second(rows, num_requests, length)
        if a is None or b is None:
            return b if a is None else a
        return a & b  # broadcast: [requests or 1, 1, length or 1, length]

    return mask_fn


# our layer module -> the checkpoint's (after the layer index), where they differ
_THEIR_LAYER_NAMES = {"Wqkv": "attn.Wqkv", "Wo": "attn.Wo", "Wi": "mlp.Wi", "mlp_out": "mlp.Wo"}
_EMBEDDING_NAMES = {
    "tok_embeddings": "embeddings.tok_embeddings",
    "embedding_norm": "embeddings.norm",
}


class ModernBertModel(nn.Module):
    """``forward(input_ids, positions) -> hidden_states [num_tokens, hidden]`` (after the final
    norm, as transformers' ``last_hidden_state``)."""

    is_causal = False
    checkpoint_prefix = "model."  # task models keep the trunk under ``model.``

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.hidden_size = config["hidden_size"]
        self.head_dim = self.hidden_size // config["num_attention_heads"]
        types = layer_types(config)
        self.rotary = {
            kind: RotaryEmbedding(self.head_dim, rope_config(config, kind)) for kind in set(types)
        }
        self.half_window = int(config.get("local_attention", 128)) // 2
        self.tok_embeddings = Embedding(config["vocab_size"], self.hidden_size)
        self.embedding_norm = _layer_norm(config)
        self.layers = nn.ModuleList(
            ModernBertLayer(config, i, kind == "sliding_attention") for i, kind in enumerate(types)
        )
        self.layer_kinds = types
        self.final_norm = _layer_norm(config)
        self.checkpoint_map = self._checkpoint_map()

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        # token_type_ids unused: ModernBERT has no token types
        x = self.embedding_norm(self.tok_embeddings(input_ids))
        tables = {kind: rotary.cos_sin(positions) for kind, rotary in self.rotary.items()}
        masks = self._mask_fn(input_ids, positions)
        window = both_masks(window_mask_fn(self.half_window), masks)
        for layer, kind in zip(self.layers, self.layer_kinds, strict=True):
            x = layer(x, tables[kind], window if layer.sliding else masks)
        return self._output(self.final_norm(x), input_ids, positions)  # [num_tokens, hidden]

    def _mask_fn(self, input_ids: torch.Tensor, positions: torch.Tensor) -> EncoderMaskFn | None:
        """What every layer's attention masks in this step besides the local window (None:
        nothing)."""
        return None

    def _output(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The trunk's output from the final norm's (ModernBERT: those)."""
        return hidden

    def _checkpoint_map(self) -> CheckpointMap:
        """The trunk's parameters under their checkpoint names; a head extends the map."""
        slots = {_checkpoint_name(name): Slot(name) for name, _ in self.named_parameters()}
        # the masked-LM head of pre-trained checkpoints; a classifier's head, served as a trunk
        unused = (r"head\.", r"decoder\.", r"classifier\.")
        return CheckpointMap(slots, prefixes=(self.checkpoint_prefix,), unused=unused)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, self.checkpoint_map, weights)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()


def _checkpoint_name(name: str) -> str:
    """The checkpoint's name of our trunk parameter ``name``."""
    module, _, kind = name.rpartition(".")
    if module in _EMBEDDING_NAMES:
        return f"{_EMBEDDING_NAMES[module]}.{kind}"
    if module.startswith("layers."):
        _, index, layer_module = module.split(".", 2)
        return f"layers.{index}.{_THEIR_LAYER_NAMES.get(layer_module, layer_module)}.{kind}"
    return name


class ModernBertForSequenceClassification(ScorerDefaults, ModernBertModel):
    """Trunk + ``classifier(norm(act(dense(pooled))))``; pooled is CLS or the mean of the
    prompt's tokens (``classifier_pooling``). The head runs in fp32."""

    classifier_pooling: PoolingMethod | None  # the config's: CLS or mean

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        config = self.config
        pooling = config.get("classifier_pooling", "cls")
        if pooling not in CLASSIFIER_POOLING:
            raise ValueError(
                f"ModernBERT classifier_pooling {pooling!r} is not supported; supported: "
                f"{', '.join(CLASSIFIER_POOLING)}"
            )
        self.classifier_pooling = pooling
        self.num_labels = num_labels_of(config)
        self.head_dense = nn.Linear(
            self.hidden_size, self.hidden_size, bias=bool(config.get("classifier_bias", False))
        )
        self.head_act = get_activation(config.get("classifier_activation", "gelu"))
        self.head_norm = _layer_norm(config)
        self.classifier = nn.Linear(self.hidden_size, self.num_labels)
        head = {
            f"{theirs}.{kind}": Slot(f"{ours}.{kind}")
            for theirs, ours in (("head.dense", "head_dense"), ("head.norm", "head_norm"))
            for kind, _ in getattr(self, ours).named_parameters()
        }
        head.update(linear_slots("classifier", "classifier"))
        self.checkpoint_map = self.checkpoint_map.extended(head)

    def compute_scores(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled [N, hidden]`` -> fp32 logits ``[N, num_labels]``."""
        x = linear_fp32(pooled, self.head_dense)
        x = F.layer_norm(
            self.head_act(x),
            x.shape[-1:],
            self.head_norm.weight.float(),
            None if self.head_norm.bias is None else self.head_norm.bias.float(),
            self.head_norm.eps,
        )
        return linear_fp32(x, self.classifier)
