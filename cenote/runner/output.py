"""What the model runner returns for one step: sampled tokens *and* pooler outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from cenote.messages import LogprobsLists
from cenote.pooling.interface import PoolerResult


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request -> new tokens
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # for the sampled tokens
    prompt_logprobs: dict[str, LogprobsLists] = field(
        default_factory=dict
    )  # this step's prompt rows
    # finished pooling requests: a tensor, or a task -> tensor map (a multi-task request)
    pooler_output: dict[str, PoolerResult] = field(default_factory=dict)
