"""BERT / RoBERTa / XLM-R with Hugging Face classification heads.

The trunk returns every token's hidden state; the pooler picks the rows (CLS for sequence
heads, all rows for token heads) and calls ``compute_scores``, which runs the head in fp32:

- BertForSequenceClassification: ``classifier(tanh(pooler.dense(h_cls)))``
- RobertaForSequenceClassification: ``out_proj(tanh(dense(h_<s>)))``
- BertForTokenClassification: ``classifier(h)`` for every token
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cenote.config import ModelConfig
from cenote.models.bert import BertModel, RobertaModel
from cenote.models.checkpoint_map import CheckpointMap, linear_slots
from cenote.models.interfaces import ScorerDefaults
from cenote.models.layers.linear import linear_fp32
from cenote.pooling.methods import PoolingMethod


def num_labels_of(config: dict[str, Any]) -> int:
    labels = config.get("id2label")
    return len(labels) if labels else int(config.get("num_labels", 2))


class TanhPoolerHead(ScorerDefaults):
    """BERT's sequence head over another trunk: pooler (dense + tanh on the CLS row) +
    ``classifier``, in fp32, from the checkpoint's ``pooler.dense`` and ``classifier``. Listed
    before the trunk class; the trunk gives ``config`` and ``hidden_size``."""

    config: dict[str, Any]
    hidden_size: int
    checkpoint_map: CheckpointMap

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)  # type: ignore[call-arg]  # the trunk's __init__
        self.num_labels = num_labels_of(self.config)
        self.pooler_dense = nn.Linear(self.hidden_size, self.hidden_size)
        self.classifier = nn.Linear(self.hidden_size, self.num_labels)
        head = {
            **linear_slots("pooler.dense", "pooler_dense"),
            **linear_slots("classifier", "classifier"),
        }
        self.checkpoint_map: CheckpointMap = self.checkpoint_map.extended(head)

    def compute_scores(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled [N, hidden]`` (CLS rows) -> fp32 logits ``[N, num_labels]``."""
        return linear_fp32(torch.tanh(linear_fp32(pooled, self.pooler_dense)), self.classifier)


class _BertWithClassifier(ScorerDefaults, BertModel):
    """BERT trunk + ``classifier``, a linear layer to the config's labels."""

    head_modules: tuple[str, ...] = ("classifier",)  # ``ReplaceableHead``

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self.num_labels = num_labels_of(self.config)
        self.classifier = nn.Linear(self.hidden_size, self.num_labels)
        self.checkpoint_map = self.checkpoint_map.extended(linear_slots("classifier", "classifier"))


class BertForSequenceClassification(_BertWithClassifier):
    """BERT trunk + HF pooler (dense + tanh on CLS) + ``classifier``."""

    head_modules: tuple[str, ...] = ("pooler_dense", "classifier")  # ``ReplaceableHead``

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        # the head reads the pooler: no longer optional
        self.checkpoint_map = self.checkpoint_map.extended(
            required=("pooler_dense.weight", "pooler_dense.bias")
        )

    def compute_scores(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled [N, hidden]`` (CLS rows) -> fp32 logits ``[N, num_labels]``."""
        return linear_fp32(torch.tanh(linear_fp32(pooled, self.pooler_dense)), self.classifier)


class RobertaClassificationHead(nn.Module):
    """HF's RobertaClassificationHead: ``out_proj(tanh(dense(x)))`` (dropout off)."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_fp32(torch.tanh(linear_fp32(x, self.dense)), self.out_proj)


class RobertaForSequenceClassification(ScorerDefaults, RobertaModel):
    """RoBERTa / XLM-R trunk + classification head on ``<s>``."""

    # ``ReplaceableHead``: an adapter's ``modules_to_save=["classifier"]`` saves both linears
    head_modules: tuple[str, ...] = ("classifier.dense", "classifier.out_proj")

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self.num_labels = num_labels_of(self.config)
        self.classifier = RobertaClassificationHead(self.hidden_size, self.num_labels)
        self.checkpoint_map = self.checkpoint_map.extended(
            {
                **linear_slots("classifier.dense", "classifier.dense"),
                **linear_slots("classifier.out_proj", "classifier.out_proj"),
            }
        )

    def compute_scores(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled)  # [N, num_labels] fp32


class BertForTokenClassification(_BertWithClassifier):
    """BERT trunk + a per-token ``classifier`` (named-entity style labels)."""

    classifier_pooling: PoolingMethod | None = None  # token_classify only

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear_fp32(hidden, self.classifier)  # [num_tokens, num_labels] fp32
