"""BERT with its masked-language-model head, for SPLADE sparse embeddings.

``compute_mlm_logits(hidden) -> [N, vocab_size]`` runs the head in fp32:
``decoder(LayerNorm(act(transform(h)))) + bias``, the decoder tied to the word embeddings
unless ``tie_word_embeddings`` is false. DistilBERT's masked LM lives in ``distilbert.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from cenote.config import ModelConfig
from cenote.models.bert import BertModel
from cenote.models.layers.activation import get_activation
from cenote.models.layers.linear import linear_fp32
from cenote.models.weights import copy_weight

# checkpoint tensors a masked LM has no use for: the next-sentence head of BERT pre-training
# checkpoints, position-id buffers, and the decoder copies transformers ties on load
_UNUSED = ("cls.seq_relationship.", "embeddings.position_ids", "cls.predictions.decoder.")


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
        self._head_names = {
            "cls.predictions.transform.dense.weight": "transform.weight",
            "cls.predictions.transform.dense.bias": "transform.bias",
            "cls.predictions.transform.LayerNorm.weight": "transform_norm.weight",
            "cls.predictions.transform.LayerNorm.bias": "transform_norm.bias",
            "cls.predictions.bias": "decoder_bias",
        }
        if not self.tied:
            self._head_names["cls.predictions.decoder.weight"] = "decoder_weight"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The trunk loads as BERT's; head tensors by name; any other tensor is refused."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def trunk_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                key = name.removeprefix("bert.")
                if key in self._head_names:
                    copy_weight(params[self._head_names[key]], tensor, name)
                    loaded.add(key)
                elif key.startswith(_UNUSED):
                    continue
                elif self._map_name(name) is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                        "does config.json name the right architecture?"
                    )
                else:
                    yield name, tensor

        loaded |= super().load_weights(trunk_weights())
        return loaded

    def required_parameters(self) -> set[str]:
        head_params = set(self._head_names.values())
        trunk = {name for name in super().required_parameters() if name not in head_params}
        return trunk | set(self._head_names)  # the head by its checkpoint names

    def compute_mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> fp32 vocabulary logits ``[N, vocab_size]``."""
        x = self.transform_act(linear_fp32(hidden, self.transform))
        norm = self.transform_norm
        assert norm.bias is not None
        x = F.layer_norm(x, (self.hidden_size,), norm.weight.float(), norm.bias.float(), norm.eps)
        weight = self.embeddings.word_embeddings.weight if self.tied else self.decoder_weight
        assert weight is not None
        return F.linear(x, weight.float(), self.decoder_bias.float())
