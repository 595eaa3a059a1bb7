"""BERT with its masked-language-model head, for SPLADE sparse embeddings.

``compute_mlm_logits(hidden) -> [N, vocab_size]`` runs the head in fp32:
``decoder(LayerNorm(act(transform(h)))) + bias``, the decoder tied to the word embeddings
unless ``tie_word_embeddings`` is false. DistilBERT's masked LM lives in ``distilbert.py``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from cenote.config import ModelConfig
from cenote.models.bert import BertModel
from cenote.models.checkpoint_map import Slot, linear_slots
from cenote.models.layers.activation import get_activation
from cenote.models.layers.linear import linear_fp32


class BertForMaskedLM(BertModel):
    """BERT trunk + ``cls.predictions`` head (transform, LayerNorm, tied decoder, bias)."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        config, hidden = self.config, self.hidden_size
        vocab_size = config["vocab_size"]
        self.tied = bool(config.get("tie_word_embeddings", True))
        self.transform = nn.Linear(hidden, hidden)
        self.transform_act = get_activation(config.get("hidden_act", "gelu"))
        self.transform_norm = nn.LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12))
        self.decoder_weight = None if self.tied else nn.Parameter(torch.empty(vocab_size, hidden))
        self.decoder_bias = nn.Parameter(torch.empty(vocab_size))
        head = {
            **linear_slots("cls.predictions.transform.dense", "transform"),
            **linear_slots("cls.predictions.transform.LayerNorm", "transform_norm"),
            "cls.predictions.bias": Slot("decoder_bias"),
        }
        if not self.tied:
            head["cls.predictions.decoder.weight"] = Slot("decoder_weight")
        # the next-sentence head of pre-training checkpoints; the decoder copies transformers
        # ties on load (its weight is the word embeddings, its bias cls.predictions.bias)
        unused = (r"cls\.seq_relationship\.", r"cls\.predictions\.decoder\.")
        trunk = self.checkpoint_map
        self.checkpoint_map = replace(trunk, unused=(r"embeddings\.position_ids",)).extended(
            head, unused
        )

    def compute_mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> fp32 vocabulary logits ``[N, vocab_size]``."""
        x = self.transform_act(linear_fp32(hidden, self.transform))
        norm = self.transform_norm
        assert norm.bias is not None
        x = F.layer_norm(x, (self.hidden_size,), norm.weight.float(), norm.bias.float(), norm.eps)
        weight = self.embeddings.word_embeddings.weight if self.tied else self.decoder_weight
        assert weight is not None
        return F.linear(x, weight.float(), self.decoder_bias.float())
