"""MPNet encoders over a flat, unpadded token stream (all-mpnet-base-v2, multi-qa-mpnet).

BERT's post-norm layer plus a relative position bias, computed as transformers computes it:
one table ``relative_attention_bias [buckets, heads]`` shared by every layer, indexed by the
T5-style bidirectional bucket of ``key position - query position`` with 32 buckets and
max_distance 128 (transformers passes neither from the config), added to the attention scores.
Absolute positions start after ``padding_idx`` (fixed at 1, as in transformers).

- MPNetForSequenceClassification: ``out_proj(tanh(dense(h_<s>)))`` (cross-encoders)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from cenote.config import ModelConfig
from cenote.models.bert import BertLayer
from cenote.models.bert_classifiers import RobertaClassificationHead, num_labels_of
from cenote.models.checkpoint_map import CheckpointMap, Slot, fused_slots, linear_slots
from cenote.models.distilbert import WordPositionEmbeddings
from cenote.models.interfaces import ScorerDefaults
from cenote.models.layers.attention import EncoderMaskFn

_PADDING_IDX = 1  # transformers' MPNetEmbeddings hard-codes it
_NUM_BUCKETS = 32  # MPNetEncoder.compute_position_bias default, whatever the config says
_MAX_DISTANCE = 128


def relative_position_bucket(relative_position: torch.Tensor) -> torch.Tensor:
    """transformers' ``MPNetEncoder.relative_position_bucket`` (bidirectional, log-spaced)."""
    num_buckets = _NUM_BUCKETS // 2
    n = -relative_position
    ret = (n < 0).to(torch.long) * num_buckets
    n = torch.abs(n)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    val_if_large = max_exact + (
        torch.log(n.float() / max_exact)
        / math.log(_MAX_DISTANCE / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    val_if_large = torch.clamp(val_if_large, max=num_buckets - 1)
    return ret + torch.where(is_small, n, val_if_large)


class MPNetLayer(BertLayer):
    """BERT's layer with the relative position bias added to the attention scores."""

    def forward(self, x: torch.Tensor, mask_fn: EncoderMaskFn | None = None) -> torch.Tensor:
        """``mask_fn``: the relative position bias of the step's requests."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = self.attn_norm(x + self.attn_out(self.attn(q, k, v, mask_fn=mask_fn)))
        return self.output_norm(x + self.output(self.act(self.intermediate(x))))


def _trunk_slots(num_layers: int) -> dict[str, Slot]:
    slots: dict[str, Slot] = {}
    for name in ("word_embeddings", "position_embeddings"):
        slots[f"embeddings.{name}.weight"] = Slot(f"embeddings.{name}.weight")
    slots.update(linear_slots("embeddings.LayerNorm", "embeddings.LayerNorm"))
    slots["encoder.relative_attention_bias.weight"] = Slot("relative_attention_bias.weight")
    for i in range(num_layers):
        src, dst = f"encoder.layer.{i}", f"layers.{i}"
        attention = [f"{src}.attention.attn.{p}" for p in "qkv"]
        slots.update(fused_slots(attention, f"{dst}.qkv"))
        slots.update(linear_slots(f"{src}.attention.attn.o", f"{dst}.attn_out"))
        slots.update(linear_slots(f"{src}.attention.LayerNorm", f"{dst}.attn_norm"))
        slots.update(linear_slots(f"{src}.intermediate.dense", f"{dst}.intermediate"))
        slots.update(linear_slots(f"{src}.output.dense", f"{dst}.output"))
        slots.update(linear_slots(f"{src}.output.LayerNorm", f"{dst}.output_norm"))
    return slots


class MPNetModel(nn.Module):
    """The trunk: ``forward(input_ids, positions) -> hidden_states [num_tokens, hidden]``."""

    is_causal = False

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.hidden_size = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        num_buckets = int(config.get("relative_attention_num_buckets", _NUM_BUCKETS))
        if num_buckets < _NUM_BUCKETS:
            raise ValueError(
                f"MPNet relative_attention_num_buckets is {num_buckets}; transformers indexes "
                f"{_NUM_BUCKETS} buckets, so at least {_NUM_BUCKETS} are supported"
            )
        self.embeddings = WordPositionEmbeddings(
            config["vocab_size"],
            config["max_position_embeddings"],
            self.hidden_size,
            config.get("layer_norm_eps", 1e-12),
            _PADDING_IDX + 1,
        )
        self.relative_attention_bias = nn.Embedding(num_buckets, self.num_heads)
        self.layers = nn.ModuleList(
            MPNetLayer(config, i) for i in range(config["num_hidden_layers"])
        )
        self.checkpoint_map = CheckpointMap(
            {**_trunk_slots(config["num_hidden_layers"]), **self._head_slots()},
            prefixes=("mpnet.",),
            # MPNetModel's CLS pooler (unused: sentence-transformers pools the hidden states)
            unused=("embeddings.position_ids", "pooler.dense."),
        )

    def _head_slots(self) -> dict[str, Slot]:
        return {}

    def position_bias(self, length: int) -> torch.Tensor:
        """[1, heads, length, length] bias of one request of ``length`` tokens."""
        positions = torch.arange(length)
        relative = positions[None, :] - positions[:, None]  # key - query
        values = self.relative_attention_bias(relative_position_bucket(relative))  # [L, L, heads]
        return values.permute(2, 0, 1).unsqueeze(0)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], 0-based within each request
        token_type_ids: torch.Tensor | None = None,  # unused: MPNet has no token types
    ) -> torch.Tensor:
        biases: dict[int, torch.Tensor] = {}  # one per distinct request length, for all layers

        def bias_fn(rows: slice, num_requests: int, length: int) -> torch.Tensor:
            if length not in biases:
                biases[length] = self.position_bias(length)
            return biases[length]

        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, bias_fn)
        return x  # [num_tokens, hidden]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.checkpoint_map.load(self, weights)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()


class MPNetForSequenceClassification(ScorerDefaults, MPNetModel):
    """Trunk + ``classifier`` (dense -> tanh -> out_proj) on ``<s>``."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self.num_labels = num_labels_of(self.config)
        self.classifier = RobertaClassificationHead(self.hidden_size, self.num_labels)

    def _head_slots(self) -> dict[str, Slot]:
        return {
            **linear_slots("classifier.dense", "classifier.dense"),
            **linear_slots("classifier.out_proj", "classifier.out_proj"),
        }

    def compute_scores(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled)  # [N, num_labels] fp32
