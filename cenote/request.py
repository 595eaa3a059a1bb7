"""The scheduler's view of one request: token ids catching up with computation."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from cenote.lora_request import LoRARequest
    from cenote.pooling_params import PoolingParams
    from cenote.sampling_params import SamplingParams
    from cenote.spec_decode.pacing import DraftPacing
    from cenote.structured.grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    HELD = 1  # not queued yet: its call's share is full (scheduler/group_shares.py)
    RUNNING = 2
    PREEMPTED = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_POOLED = 7
    FINISHED_ERROR = 8  # its step raised; the request gets an error output

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_POOLED: "stop",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """A request inside the engine core.

    Invariant: ``num_computed_tokens <= num_tokens``; the scheduler only moves
    ``num_computed_tokens`` forward (or back to 0 on preemption).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # set for generation requests
    pooling_params: PoolingParams | None  # set for pooling requests
    token_type_ids: list[int] | None = None  # segment ids for cross-encoders
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first when the scheduler uses priorities
    group_id: str | None = None  # the call it came in; the scheduler shares among calls
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    num_prompt_logprobs_sent: int = 0  # prompt positions whose logprobs were returned (recompute)
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    # time.monotonic() in the core process when the core took the request (``arrival_time`` is
    # the front's): queue and inference durations are measured against this clock only
    added_time: float = field(default_factory=time.monotonic)
    grammar: RequestGrammar | None = None  # structured outputs: the output's matcher
    lora_request: LoRARequest | None = None  # the adapter it runs under; None: the base model
    pixel_values: torch.Tensor | None = None  # an image prompt's pixels (placeholder token ids)
    draft_pacing: DraftPacing | None = None  # speculative decoding: its draft lengths

    @property
    def block_hash_keys(self) -> tuple[object, ...] | None:
        """What its KV blocks' hashes add to the tokens: the adapter (the same prompt under two
        adapters, or one and the base, never shares blocks)."""
        lora = self.lora_request
        return None if lora is None else ("lora", lora.lora_int_id, lora.lora_path)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
