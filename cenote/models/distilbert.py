"""DistilBERT encoders over a flat, unpadded token stream (msmarco-distilbert, SPLADE students).

The layer is BERT's post-norm layer (q/k/v fused); the differences are in the names and in
the embeddings (no token types, LayerNorm eps fixed at 1e-12). Heads:

- DistilBertForSequenceClassification: ``classifier(relu(pre_classifier(h_cls)))``
- DistilBertForMaskedLM: ``vocab_projector(LayerNorm(act(vocab_transform(h))))``, the projector
  tied to the word embeddings (SPLADE; see ``masked_lm.py`` for the shared contract)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cenote.config import ModelConfig
from cenote.models.bert_classifiers import num_labels_of
from cenote.models.checkpoint_map import Slot, linear_slots
from cenote.models.interfaces import ScorerDefaults
from cenote.models.layers.activation import get_activation
from cenote.models.layers.linear import linear_fp32
from cenote.models.word_position_encoder import TrunkNames, WordPositionEncoder

_EPS = 1e-12  # DistilBERT's LayerNorms ignore config.layer_norm_eps


def _bert_layer_config(config: dict[str, Any]) -> dict[str, Any]:
    """DistilBERT's config keys as ``BertLayer`` reads them."""
    return {
        "hidden_size": config["dim"],
        "num_hidden_layers": config["n_layers"],
        "num_attention_heads": config["n_heads"],
        "intermediate_size": config["hidden_dim"],
        "hidden_act": config.get("activation", "gelu"),
        "layer_norm_eps": _EPS,
    }


class DistilBertModel(WordPositionEncoder):
    """The trunk: ``forward(input_ids, positions) -> hidden_states [num_tokens, dim]``."""

    names = TrunkNames(
        prefix="distilbert.",
        layers="transformer.layer",
        qkv=("attention.q_lin", "attention.k_lin", "attention.v_lin"),
        modules=("attention.out_lin", "sa_layer_norm", "ffn.lin1", "ffn.lin2", "output_layer_norm"),
    )

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config, _bert_layer_config(model_config.hf_config), 0)


class DistilBertForSequenceClassification(ScorerDefaults, DistilBertModel):
    """Trunk + ``classifier(relu(pre_classifier(h_cls)))`` (msmarco cross-encoders)."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self.num_labels = num_labels_of(self.config)
        self.pre_classifier = nn.Linear(self.hidden_size, self.hidden_size)
        self.classifier = nn.Linear(self.hidden_size, self.num_labels)
        head = {
            **linear_slots("pre_classifier", "pre_classifier"),
            **linear_slots("classifier", "classifier"),
        }
        self.checkpoint_map = self.checkpoint_map.extended(head)

    def compute_scores(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled [N, dim]`` (CLS rows) -> fp32 logits ``[N, num_labels]``."""
        hidden = torch.relu(linear_fp32(pooled, self.pre_classifier))
        return linear_fp32(hidden, self.classifier)


class DistilBertForMaskedLM(DistilBertModel):
    """Trunk + masked-LM head; ``compute_mlm_logits`` runs it in fp32 (SPLADE)."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self.tied = bool(self.config.get("tie_word_embeddings", True))
        config, hidden = self.config, self.hidden_size
        self.act = get_activation(config.get("activation", "gelu"))
        self.vocab_transform = nn.Linear(hidden, hidden)
        self.vocab_layer_norm = nn.LayerNorm(hidden, eps=_EPS)
        # the projector's weight is the word embeddings unless untied
        self.vocab_weight = (
            None if self.tied else nn.Parameter(torch.empty(config["vocab_size"], hidden))
        )
        self.vocab_bias = nn.Parameter(torch.empty(config["vocab_size"]))
        head = {
            **linear_slots("vocab_transform", "vocab_transform"),
            **linear_slots("vocab_layer_norm", "vocab_layer_norm"),
            "vocab_projector.bias": Slot("vocab_bias"),
        }
        if not self.tied:
            head["vocab_projector.weight"] = Slot("vocab_weight")
        # older checkpoints also store the tied projector; transformers ties it on load
        unused = () if not self.tied else (r"vocab_projector\.weight",)
        self.checkpoint_map = self.checkpoint_map.extended(head, unused)

    def compute_mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, dim]`` -> fp32 vocabulary logits ``[N, vocab_size]``."""
        x = self.act(linear_fp32(hidden, self.vocab_transform))
        norm = self.vocab_layer_norm
        assert norm.bias is not None
        x = F.layer_norm(x, (self.hidden_size,), norm.weight.float(), norm.bias.float(), _EPS)
        weight = self.embeddings.word_embeddings.weight if self.tied else self.vocab_weight
        assert weight is not None
        return F.linear(x, weight.float(), self.vocab_bias.float())
