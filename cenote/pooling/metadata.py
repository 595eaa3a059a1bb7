"""What the pooler needs to know about the requests it pools in one step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch

from cenote.pooling_params import PoolingParams

ScoreFn = Callable[[torch.Tensor], torch.Tensor]  # [N, hidden] fp32 -> [N, num_labels] fp32


@dataclass
class PoolingMetadata:
    """Pooled requests, in the order of their rows in the hidden states handed to the pooler.

    Each request's rows are its whole prompt: ``hidden_states[start_loc[i]:start_loc[i + 1]]``.
    """

    start_loc: list[int]  # [num_requests + 1] cumulative prompt lengths
    pooling_params: list[PoolingParams]  # [num_requests], task always set
    prompt_token_ids: list[list[int]]  # [num_requests] the prompts (STEP pooling reads them)
    # [num_requests] a request's own classification head (its LoRA adapter's modules_to_save),
    # None: the model's; the field is None when no request brings one
    head_scores: list[ScoreFn | None] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.pooling_params)

    @property
    def prompt_lens(self) -> list[int]:
        return [end - start for start, end in pairwise(self.start_loc)]

    def segment_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[num_tokens] index of the request each row belongs to, on ``device`` (the hidden
        states')."""
        lens = torch.tensor(self.prompt_lens, device=device)
        return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
