"""MPNet encoders over a flat, unpadded token stream (all-mpnet-base-v2, multi-qa-mpnet).

BERT's post-norm layer plus a relative position bias, computed as transformers computes it:
one table ``relative_attention_bias [buckets, heads]`` shared by every layer, indexed by the
T5-style bidirectional bucket of ``key position - query position`` with 32 buckets and
max_distance 128 (transformers passes neither from the config), added to the attention scores.
Absolute positions start after ``padding_idx`` (fixed at 1, as in transformers).

- MPNetForSequenceClassification: ``out_proj(tanh(dense(h_<s>)))`` (cross-encoders)
"""

from __future__ import annotations

import torch

from cenote.config import ModelConfig
from cenote.models.bert_classifiers import RobertaClassificationHead, num_labels_of
from cenote.models.checkpoint_map import linear_slots
from cenote.models.interfaces import ScorerDefaults
from cenote.models.layers.attention import EncoderMaskFn
from cenote.models.layers.relative_position import RelativePositionBias
from cenote.models.word_position_encoder import TrunkNames, WordPositionEncoder

_PADDING_IDX = 1  # transformers' MPNetEmbeddings hard-codes it
_NUM_BUCKETS = 32  # MPNetEncoder.compute_position_bias default, whatever the config says
_MAX_DISTANCE = 128


class MPNetModel(WordPositionEncoder):
    """The trunk: ``forward(input_ids, positions) -> hidden_states [num_tokens, hidden]``."""

    names = TrunkNames(
        prefix="mpnet.",
        layers="encoder.layer",
        qkv=("attention.attn.q", "attention.attn.k", "attention.attn.v"),
        modules=(
            "attention.attn.o",
            "attention.LayerNorm",
            "intermediate.dense",
            "output.dense",
            "output.LayerNorm",
        ),
        # MPNetModel's CLS pooler (unused: sentence-transformers pools the hidden states)
        unused=("embeddings.position_ids", "pooler.dense."),
        renamed={"encoder.relative_attention_bias.weight": "relative_attention_bias.weight"},
    )

    def __init__(self, model_config: ModelConfig) -> None:
        config = model_config.hf_config
        num_buckets = int(config.get("relative_attention_num_buckets", _NUM_BUCKETS))
        if num_buckets < _NUM_BUCKETS:
            raise ValueError(
                f"MPNet relative_attention_num_buckets is {num_buckets}; transformers indexes "
                f"{_NUM_BUCKETS} buckets, so at least {_NUM_BUCKETS} are supported"
            )
        super().__init__(model_config, config, _PADDING_IDX + 1)
        self.relative_attention_bias = RelativePositionBias(
            num_buckets, config["num_attention_heads"], _NUM_BUCKETS, _MAX_DISTANCE
        )

    def _mask_fn(self, dtype: torch.dtype) -> EncoderMaskFn:
        return self.relative_attention_bias.mask_fn(dtype)


class MPNetForSequenceClassification(ScorerDefaults, MPNetModel):
    """Trunk + ``classifier`` (dense -> tanh -> out_proj) on ``<s>``."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self.num_labels = num_labels_of(self.config)
        self.classifier = RobertaClassificationHead(self.hidden_size, self.num_labels)
        head = {
            **linear_slots("classifier.dense", "classifier.dense"),
            **linear_slots("classifier.out_proj", "classifier.out_proj"),
        }
        self.checkpoint_map = self.checkpoint_map.extended(head)

    def compute_scores(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled)  # [N, num_labels] fp32
