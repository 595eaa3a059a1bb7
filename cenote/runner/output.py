"""What the model runner returns for one step: sampled tokens *and* pooler outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cenote.messages import LogprobsLists


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request -> new tokens
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # for the sampled tokens
    prompt_logprobs: dict[str, LogprobsLists] = field(
        default_factory=dict
    )  # this step's prompt rows
    pooler_output: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # finished pooling requests
