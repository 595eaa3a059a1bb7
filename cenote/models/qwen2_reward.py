"""Qwen2 reward models (``trust_remote_code`` on the Hub, implemented natively from their
published structure; nothing from the model folder runs).

Both are the Qwen2 trunk with an MLP head ``score = Sequential(Linear(hidden, hidden), ReLU,
Linear(hidden, num_labels))`` (checkpoint names ``score.0.*`` and ``score.2.*``):

- ``Qwen2ForRewardModel`` (Qwen2.5-Math-RM): a raw reward per token (``token_classify``, ALL
  pooling) or for the last token (``classify``); no activation by default.
- ``Qwen2ForProcessRewardModel`` (Qwen2.5-Math-PRM): two labels, softmax, at the STEP rows
  where token == ``step_tag_id`` (per request, else the config's ``step_tag_id``, else every row).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cenote.config import ModelConfig
from cenote.models.checkpoint_map import linear_slots
from cenote.models.layers.quant import QuantizedWeight
from cenote.models.llama import LlamaDecoder
from cenote.pooling.activation import Activation
from cenote.pooling.methods import PoolingMethod


class Qwen2RewardBase(LlamaDecoder):
    """Qwen2 trunk + the reward MLP head; ``compute_scores`` is the head in fp32."""

    variant = "qwen2"
    default_num_labels: ClassVar[int]
    # what the pooler applies unless use_activation=False
    default_activation: Activation | None
    # classify reads the last token; None: token_classify only
    classifier_pooling: PoolingMethod | None = "last"
    step_tag_id: int | None = None  # STEP tag for requests that pass none (None: every row)

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        # the remote code fixes the label count; transformers' default id2label (2 labels) is
        # not read, only an explicit num_labels entry
        self.num_labels = int(self.config.get("num_labels", self.default_num_labels))
        self.score = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size),
            nn.ReLU(),
            nn.Linear(self.hidden_size, self.num_labels),
        )
        head = {**linear_slots("score.0", "score.0"), **linear_slots("score.2", "score.2")}
        self.checkpoint_map = self.checkpoint_map.extended(head)

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> fp32 rewards ``[N, num_labels]`` (the head runs in fp32)."""
        first, last = self.score[0], self.score[2]
        assert isinstance(first, nn.Linear) and isinstance(last, nn.Linear)
        x = F.relu(F.linear(hidden.float(), first.weight.float(), first.bias.float()))
        return F.linear(x, last.weight.float(), last.bias.float())  # [N, num_labels]

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
    ) -> set[str]:
        """The trunk's loading, with the head's shapes checked (a copy would broadcast)."""
        head = {name: param for name, param in self.named_parameters() if name.startswith("score.")}

        def checked() -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
            for name, tensor in weights:
                if name in head and tensor.shape != head[name].shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, but "
                        f"{type(self).__name__} with hidden_size {self.hidden_size} and "
                        f"num_labels {self.num_labels} expects {tuple(head[name].shape)}; set "
                        "num_labels in config.json (or hf_overrides) to match the checkpoint"
                    )
                yield name, tensor

        return super().load_weights(checked())


class Qwen2ForRewardModel(Qwen2RewardBase):
    """Outcome reward: one raw score per token (``token_classify``) or per prompt
    (``classify``, last token)."""

    default_num_labels = 1
    default_activation = "identity"


class Qwen2ForProcessRewardModel(Qwen2RewardBase):
    """Process reward: softmax over (negative, positive) at each step tag (``token_classify``)."""

    default_num_labels = 2
    default_activation = "softmax"
    classifier_pooling = None

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        step_tag_id = self.config.get("step_tag_id")
        vocab = model_config.vocab_size
        if step_tag_id is not None and not (
            isinstance(step_tag_id, int) and 0 <= step_tag_id < vocab
        ):
            raise ValueError(
                f"config step_tag_id {step_tag_id!r} is outside the vocabulary (size {vocab})"
            )
        self.step_tag_id = step_tag_id
