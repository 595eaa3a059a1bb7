"""BERT, RoBERTa and XLM-RoBERTa encoders over a flat, unpadded token stream."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.models.checkpoint_map import LinearSlot
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention, EncoderMaskFn
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import (
    GELU_APPROXIMATE,
    TrunkLinear,
    linear_add_norm,
    linear_gelu,
)
from cenote.models.layers.norm import LayerNorm
from cenote.models.weights import copy_weight


class BertEmbeddings(nn.Module):
    def __init__(self, config: dict[str, Any], position_offset: int) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.word_embeddings = Embedding(config["vocab_size"], hidden)
        self.position_embeddings = Embedding(config["max_position_embeddings"], hidden)
        self.token_type_embeddings = Embedding(config.get("type_vocab_size", 2), hidden)
        self.LayerNorm = LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12))
        self.position_offset = position_offset  # RoBERTa: positions start after padding_idx

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset
        )
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm.normalize_(x)  # [num_tokens, hidden]; x: this step's sum


class BertLayer(nn.Module):
    """Post-norm encoder layer with a fused QKV projection."""

    def __init__(self, config: dict[str, Any], layer_idx: int) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        eps = config.get("layer_norm_eps", 1e-12)
        self.head_dim = hidden // heads
        self.qkv = TrunkLinear(hidden, 3 * hidden)
        self.attn = Attention(heads, self.head_dim, heads, layer_idx, self.head_dim**-0.5)
        self.attn_out = TrunkLinear(hidden, hidden)
        self.attn_norm = LayerNorm(hidden, eps=eps)
        self.intermediate = TrunkLinear(hidden, config["intermediate_size"])
        activation = config.get("hidden_act", "gelu")
        self.act = get_activation(activation)
        self.gelu_approximate = GELU_APPROXIMATE.get(activation)  # None: not a GELU
        self.output = TrunkLinear(config["intermediate_size"], hidden)
        self.output_norm = LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask_fn: EncoderMaskFn | None = None) -> torch.Tensor:
        """The GELU runs as the matmul's epilogue (``linear_gelu``), each residual add either
        as the matmul's epilogue or inside the LayerNorm kernel, whichever this CPU runs faster
        (``linear_add_norm``); the norms overwrite the sums they normalize (temporaries of this
        layer)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = linear_add_norm(self.attn_out, self.attn(q, k, v, mask_fn), x, self.attn_norm)
        return self.feed_forward(x)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``output_norm(x + output(act(intermediate(x))))``, the layer's second half."""
        if self.gelu_approximate is None:
            inner = self.act(self.intermediate(x))
        else:
            inner = linear_gelu(self.intermediate, x, self.gelu_approximate)
        return linear_add_norm(self.output, inner, x, self.output_norm)


# checkpoint name -> our name, for the parts of a layer whose names differ
_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "output_norm",
}
_QKV = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}


class BertModel(nn.Module):
    """The encoder trunk: ``forward(input_ids, positions) -> hidden_states [num_tokens, hidden]``."""

    is_causal = False
    checkpoint_prefixes: tuple[str, ...] = ("bert.", "model.")
    has_classifier_head = False  # a task head (bert_classifiers.py) loads ``classifier.*``

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.hidden_size = config["hidden_size"]
        self.embeddings = BertEmbeddings(config, self._position_offset(config))
        self.layers = nn.ModuleList(
            BertLayer(config, i) for i in range(config["num_hidden_layers"])
        )
        self.pooler_dense = nn.Linear(self.hidden_size, self.hidden_size)  # HF BertPooler (CLS)
        self.has_pooler_weights = False

    @staticmethod
    def _position_offset(config: dict[str, Any]) -> int:
        return 0

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        mask_fn = self._mask_fn(input_ids, positions)
        for layer in self.layers:
            x = layer(x, mask_fn)
        return self._output(x, input_ids, positions)  # [num_tokens, hidden_size]

    def _mask_fn(self, input_ids: torch.Tensor, positions: torch.Tensor) -> EncoderMaskFn | None:
        """What every layer's attention masks in this step (None: nothing)."""
        return None

    def _output(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The trunk's output from the last layer's hidden states (BERT: those)."""
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the module; returns the names of our parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._map_name(name)
            if target is None:
                continue
            our_name, shard = target
            param: torch.Tensor = params[our_name]
            if shard is not None:
                size = param.shape[0] // 3
                param = param[shard * size : (shard + 1) * size]
            copy_weight(param, tensor, name)
            loaded.add(our_name if shard is None else f"{our_name}[{shard}]")
        self.has_pooler_weights = "pooler_dense.weight" in loaded
        return loaded

    def _map_name(self, name: str) -> tuple[str, int | None] | None:
        for prefix in self.checkpoint_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name.startswith("embeddings."):
            return None if name.endswith("position_ids") else (name, None)
        if name.startswith("pooler.dense."):
            return "pooler_dense." + name.rsplit(".", 1)[-1], None
        if name.startswith("classifier."):
            # a task head (bert_classifiers.py) keeps HF's names; trunks skip it
            return (name, None) if self.has_classifier_head else None
        if not name.startswith("encoder.layer."):
            return None
        rest = name[len("encoder.layer.") :]
        index, rest = rest.split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if module in _QKV:
            return f"layers.{index}.qkv.{kind}", _QKV[module]
        if module in _LAYER_NAMES:
            return f"layers.{index}.{_LAYER_NAMES[module]}.{kind}", None
        return None

    def linear_slot(self, checkpoint_name: str) -> LinearSlot | None:
        """Where ``<module>.weight`` lives: query/key/value are thirds of the fused ``qkv``
        (``LoRATarget``)."""
        target = self._map_name(checkpoint_name)
        if target is None or not target[0].endswith(".weight"):
            return None
        module_name, shard = target[0].removesuffix(".weight"), target[1]
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            return None
        if not isinstance(module, nn.Linear):
            return None
        if shard is None:
            return LinearSlot(module_name, 0, module.out_features)
        size = module.out_features // 3
        return LinearSlot(module_name, shard * size, (shard + 1) * size)

    def required_parameters(self) -> set[str]:
        names: set[str] = set()
        for name, _ in self.named_parameters():
            if name.startswith("pooler_dense."):
                continue
            if name.endswith("qkv.weight") or name.endswith("qkv.bias"):
                names.update(f"{name}[{i}]" for i in range(3))
            else:
                names.add(name)
        return names


class RobertaModel(BertModel):
    """RoBERTa / XLM-R: BERT with positions that start after ``padding_idx``.

    Hugging Face numbers positions ``padding_idx + 1 + i`` for the non-padding tokens of a
    sequence; prompts here never contain padding, so the offset is constant.
    """

    checkpoint_prefixes = ("roberta.", "model.")

    @staticmethod
    def _position_offset(config: dict[str, Any]) -> int:
        return int(config.get("pad_token_id", 1)) + 1
