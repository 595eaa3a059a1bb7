"""BERT's post-norm layers over word + absolute position embeddings, without token types:
the trunk of DistilBERT and MPNet. Checkpoints load through an explicit ``CheckpointMap`` built
from how each family names a layer's modules (``TrunkNames``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.models.bert import BertLayer
from cenote.models.checkpoint_map import CheckpointMap, Slot, fused_slots, linear_slots
from cenote.models.layers.attention import EncoderMaskFn
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.norm import LayerNorm

# BertLayer's modules after its fused qkv, in the order ``TrunkNames.modules`` lists them
_LAYER_MODULES = ("attn_out", "attn_norm", "intermediate", "output", "output_norm")


class WordPositionEmbeddings(nn.Module):
    """Word + absolute position embeddings, then LayerNorm (no token types)."""

    def __init__(
        self, vocab_size: int, max_positions: int, hidden: int, eps: float, position_offset: int
    ) -> None:
        super().__init__()
        self.word_embeddings = Embedding(vocab_size, hidden)
        self.position_embeddings = Embedding(max_positions, hidden)
        self.LayerNorm = LayerNorm(hidden, eps=eps)
        self.position_offset = position_offset  # MPNet: positions start after padding_idx

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset
        )
        return self.LayerNorm.normalize_(x)  # [num_tokens, hidden]; x: this step's sum


@dataclass(frozen=True)
class TrunkNames:
    """How a family's checkpoint names the trunk's tensors (embeddings are named as ours)."""

    prefix: str  # the trunk inside a task model: ``distilbert.``
    layers: str  # the layer list: ``transformer.layer``
    qkv: tuple[str, str, str]  # a layer's q, k, v modules
    modules: tuple[str, str, str, str, str]  # attn_out, attn_norm, intermediate, output, norm
    unused: tuple[str, ...] = ("embeddings.position_ids",)  # name prefixes with no slot
    renamed: dict[str, str] = field(default_factory=dict)  # other checkpoint name -> ours

    def slots(self, num_layers: int) -> dict[str, Slot]:
        slots = {name: Slot(ours) for name, ours in self.renamed.items()}
        for name in ("word_embeddings", "position_embeddings"):
            slots[f"embeddings.{name}.weight"] = Slot(f"embeddings.{name}.weight")
        slots.update(linear_slots("embeddings.LayerNorm", "embeddings.LayerNorm"))
        for i in range(num_layers):
            src, dst = f"{self.layers}.{i}", f"layers.{i}"
            slots.update(fused_slots([f"{src}.{m}" for m in self.qkv], f"{dst}.qkv"))
            for module, ours in zip(self.modules, _LAYER_MODULES, strict=True):
                slots.update(linear_slots(f"{src}.{module}", f"{dst}.{ours}"))
        return slots


class WordPositionEncoder(nn.Module):
    """The trunk: ``forward(input_ids, positions) -> hidden_states [num_tokens, hidden]``.

    ``layer_config`` is the config in ``BertLayer``'s keys (``hidden_size``,
    ``num_hidden_layers``, ``layer_norm_eps``...). A task model builds its head after the
    trunk and extends ``checkpoint_map`` with the head's slots."""

    is_causal = False
    names: ClassVar[TrunkNames]

    def __init__(
        self, model_config: ModelConfig, layer_config: dict[str, Any], position_offset: int
    ) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.hidden_size: int = layer_config["hidden_size"]
        self.embeddings = WordPositionEmbeddings(
            config["vocab_size"],
            config["max_position_embeddings"],
            self.hidden_size,
            layer_config.get("layer_norm_eps", 1e-12),
            position_offset,
        )
        num_layers = layer_config["num_hidden_layers"]
        self.layers = nn.ModuleList(BertLayer(layer_config, i) for i in range(num_layers))
        self.checkpoint_map = CheckpointMap(
            self.names.slots(num_layers),
            prefixes=(self.names.prefix,),
            unused=self.names.unused,
        )

    def _mask_fn(self, dtype: torch.dtype) -> EncoderMaskFn | None:
        """What every layer adds to its attention scores in this step (None: nothing)."""
        return None

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        # token_type_ids unused: these encoders have no token types
        x = self.embeddings(input_ids, positions)
        mask_fn = self._mask_fn(x.dtype)
        for layer in self.layers:
            x = layer(x, mask_fn)
        return x  # [num_tokens, hidden]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.checkpoint_map.load(self, weights)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()
