"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cenote.pooling_params import PoolingParams
from cenote.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from cenote.structured.grammar import RequestGrammar


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions ``start_position...``."""

    request_id: str
    token_ids: list[int]  # the new tokens to compute this step
    start_position: int  # num_computed_tokens before this step
    block_ids: list[int]  # KV blocks of the whole request (empty for encoders)
    prompt_token_ids: list[int]  # the whole prompt (penalties, STEP pooling, accumulation)
    output_token_ids: list[int]  # generated so far (penalties); not a copy: read, never write
    token_type_ids: list[int] | None  # segment ids of the new tokens (cross-encoders)
    sampling_params: SamplingParams | None  # generation request
    pooling_params: PoolingParams | None  # pooling request
    eos_token_id: int | None  # banned before min_tokens; ends generation unless ignore_eos
    completes_prompt: bool  # this step computes the last prompt token (pool now)
    needs_sample: bool  # this step reaches the end of the known tokens (sample now)
    grammar: RequestGrammar | None = None  # structured outputs: masks the sampled row
    lora_int_id: int | None = None  # the LoRA adapter its rows run under; None: the base
    pixel_values: torch.Tensor | None = None  # an image prompt's pixels (encoders: scheduled whole)
    # speculative decoding: the last tokens of token_ids are these drafts, to verify (needs_sample)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step: every scheduled request, in batch order."""

    scheduled: list[ScheduledRequest]  # batch order = order of rows in the flat token stream
    total_num_scheduled_tokens: int  # <= max_num_batched_tokens
    preempted_request_ids: list[str] = field(default_factory=list)  # runner drops their state
    finished_request_ids: set[str] = field(default_factory=set)  # finished since the last step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
