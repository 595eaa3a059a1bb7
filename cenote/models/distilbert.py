"""DistilBERT encoders over a flat, unpadded token stream (msmarco-distilbert, SPLADE students).

The layer is BERT's post-norm layer (q/k/v fused); the differences are in the names and in
the embeddings (no token types, LayerNorm eps fixed at 1e-12). Heads:

- DistilBertForSequenceClassification: ``classifier(relu(pre_classifier(h_cls)))``
- DistilBertForMaskedLM: ``vocab_projector(LayerNorm(act(vocab_transform(h))))``, the projector
  tied to the word embeddings (SPLADE; see ``masked_lm.py`` for the shared contract)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cenote.config import ModelConfig
from cenote.models.bert import BertLayer
from cenote.models.bert_classifiers import _linear_fp32, num_labels_of
from cenote.models.checkpoint_map import CheckpointMap, Slot, fused_slots, linear_slots
from cenote.models.interfaces import ScorerDefaults
from cenote.models.layers.activation import get_activation

_EPS = 1e-12  # DistilBERT's LayerNorms ignore config.layer_norm_eps


class WordPositionEmbeddings(nn.Module):
    """Word + absolute position embeddings, then LayerNorm (no token types)."""

    def __init__(
        self, vocab_size: int, max_positions: int, hidden: int, eps: float, position_offset: int
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.position_offset = position_offset  # MPNet: positions start after padding_idx

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset
        )
        return self.LayerNorm(x)  # [num_tokens, hidden]


def _bert_layer_config(config: dict[str, Any]) -> dict[str, Any]:
    """DistilBERT's config keys as ``BertLayer`` reads them."""
    return {
        "hidden_size": config["dim"],
        "num_attention_heads": config["n_heads"],
        "intermediate_size": config["hidden_dim"],
        "hidden_act": config.get("activation", "gelu"),
        "layer_norm_eps": _EPS,
    }


def _trunk_slots(num_layers: int) -> dict[str, Slot]:
    slots: dict[str, Slot] = {}
    for name in ("word_embeddings", "position_embeddings"):
        slots[f"embeddings.{name}.weight"] = Slot(f"embeddings.{name}.weight")
    slots.update(linear_slots("embeddings.LayerNorm", "embeddings.LayerNorm"))
    for i in range(num_layers):
        src, dst = f"transformer.layer.{i}", f"layers.{i}"
        attention = [f"{src}.attention.{p}_lin" for p in "qkv"]
        slots.update(fused_slots(attention, f"{dst}.qkv"))
        slots.update(linear_slots(f"{src}.attention.out_lin", f"{dst}.attn_out"))
        slots.update(linear_slots(f"{src}.sa_layer_norm", f"{dst}.attn_norm"))
        slots.update(linear_slots(f"{src}.ffn.lin1", f"{dst}.intermediate"))
        slots.update(linear_slots(f"{src}.ffn.lin2", f"{dst}.output"))
        slots.update(linear_slots(f"{src}.output_layer_norm", f"{dst}.output_norm"))
    return slots


class DistilBertModel(nn.Module):
    """The trunk: ``forward(input_ids, positions) -> hidden_states [num_tokens, dim]``."""

    is_causal = False

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.hidden_size = config["dim"]
        self.embeddings = WordPositionEmbeddings(
            config["vocab_size"], config["max_position_embeddings"], self.hidden_size, _EPS, 0
        )
        layer_config = _bert_layer_config(config)
        self.layers = nn.ModuleList(BertLayer(layer_config, i) for i in range(config["n_layers"]))
        self.checkpoint_map = CheckpointMap(
            {**_trunk_slots(config["n_layers"]), **self._head_slots()},
            prefixes=("distilbert.",),
            unused=("embeddings.position_ids", *self._unused()),
        )

    def _head_slots(self) -> dict[str, Slot]:
        return {}

    def _unused(self) -> tuple[str, ...]:
        return ()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], 0-based within each request
        token_type_ids: torch.Tensor | None = None,  # unused: DistilBERT has no token types
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x)
        return x  # [num_tokens, dim]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.checkpoint_map.load(self, weights)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()


class DistilBertForSequenceClassification(ScorerDefaults, DistilBertModel):
    """Trunk + ``classifier(relu(pre_classifier(h_cls)))`` (msmarco cross-encoders)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.num_labels = num_labels_of(model_config.hf_config)
        super().__init__(model_config)
        self.pre_classifier = nn.Linear(self.hidden_size, self.hidden_size)
        self.classifier = nn.Linear(self.hidden_size, self.num_labels)

    def _head_slots(self) -> dict[str, Slot]:
        return {
            **linear_slots("pre_classifier", "pre_classifier"),
            **linear_slots("classifier", "classifier"),
        }

    def compute_scores(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled [N, dim]`` (CLS rows) -> fp32 logits ``[N, num_labels]``."""
        hidden = torch.relu(_linear_fp32(pooled, self.pre_classifier))
        return _linear_fp32(hidden, self.classifier)


class DistilBertForMaskedLM(DistilBertModel):
    """Trunk + masked-LM head; ``compute_mlm_logits`` runs it in fp32 (SPLADE)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.tied = bool(model_config.hf_config.get("tie_word_embeddings", True))
        super().__init__(model_config)
        config, hidden = self.config, self.hidden_size
        self.act = get_activation(config.get("activation", "gelu"))
        self.vocab_transform = nn.Linear(hidden, hidden)
        self.vocab_layer_norm = nn.LayerNorm(hidden, eps=_EPS)
        # the projector's weight is the word embeddings unless untied
        self.vocab_weight = (
            None if self.tied else nn.Parameter(torch.empty(config["vocab_size"], hidden))
        )
        self.vocab_bias = nn.Parameter(torch.empty(config["vocab_size"]))

    def _head_slots(self) -> dict[str, Slot]:
        slots = {
            **linear_slots("vocab_transform", "vocab_transform"),
            **linear_slots("vocab_layer_norm", "vocab_layer_norm"),
            "vocab_projector.bias": Slot("vocab_bias"),
        }
        if not self.tied:
            slots["vocab_projector.weight"] = Slot("vocab_weight")
        return slots

    def _unused(self) -> tuple[str, ...]:
        # older checkpoints also store the tied projector; transformers ties it on load
        return ("vocab_projector.weight",) if self.tied else ()

    def compute_mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, dim]`` -> fp32 vocabulary logits ``[N, vocab_size]``."""
        x = self.act(_linear_fp32(hidden, self.vocab_transform))
        norm = self.vocab_layer_norm
        assert norm.bias is not None
        x = F.layer_norm(x, (self.hidden_size,), norm.weight.float(), norm.bias.float(), _EPS)
        weight = self.embeddings.word_embeddings.weight if self.tied else self.vocab_weight
        assert weight is not None
        return F.linear(x, weight.float(), self.vocab_bias.float())
