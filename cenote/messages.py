"""Typed messages shared by the layers: front end <-> engine core (they may cross a process),
scheduler and runner outputs. Low in the package: it imports only the parameter types and the
pooler's result type."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from cenote.lora_request import LoRARequest
from cenote.pooling.interface import PoolerResult
from cenote.pooling_params import PoolingParams
from cenote.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """A validated, tokenized request, ready for the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # exactly one of sampling_params / pooling_params
    pooling_params: PoolingParams | None
    token_type_ids: list[int] | None = None  # segment ids (cross-encoder pairs)
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    lora_request: LoRARequest | None = None  # the adapter it runs under; None: the base model
    # the call it came in (the client's ``add`` sets it): the scheduler shares its queues
    # fairly among calls; None: never held back
    group_id: str | None = None
    # an image prompt: [3, height, width] fp32, preprocessed in the front; its prompt_token_ids
    # are placeholders, one per image token (the vision tower reads these pixels)
    pixel_values: torch.Tensor | None = None


@dataclass
class LogprobsLists:
    """Top-k logprobs of some positions: row i has token_ids[i][0] = the chosen token."""

    token_ids: list[list[int]]  # [num_positions][1 + k]
    logprobs: list[list[float]]  # [num_positions][1 + k]
    ranks: list[int]  # [num_positions] rank of the chosen token (1 = most likely)


@dataclass
class RequestError:
    """Why the core finished a request without a result."""

    code: Literal["refused", "failed"]  # refused: cannot run as given; failed: its step raised
    message: str  # the cause, with the numbers


@dataclass
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)  # sampled this step
    new_logprobs: LogprobsLists | None = None  # for new_token_ids, if asked
    new_prompt_logprobs: LogprobsLists | None = None  # for prompt positions computed this step
    pooling_output: torch.Tensor | None = None  # pooled result, when a pooling request finishes
    # a finished multi-task request's results, by task (a separate field: msgspec decodes no
    # union of a tensor and a map)
    pooling_outputs: dict[str, torch.Tensor] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None if running
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: RequestError | None = None  # set when finish_reason is "error"
    # seconds from the core taking the request to its first scheduling, and from then to this
    # output (the core's own monotonic clock); on a finished pooling output and on every
    # generation output (the front may finish one by a stop string); None on errors and aborts
    queue_seconds: float | None = None
    inference_seconds: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """Queue and cache gauges after a step (metrics)."""

    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up since the last stats
    prefix_cache_hits: int = 0  # tokens found
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted in the step
    num_accepted_tokens: int = 0  # of those, accepted by verification


@dataclass
class EngineCoreOutputs:
    """Everything one ``EngineCore.step()`` produced."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None


@dataclass
class ModelRunnerOutput:
    """What the model runner returns for one step: sampled tokens *and* pooler outputs."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request -> new tokens
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # for the sampled tokens
    prompt_logprobs: dict[str, LogprobsLists] = field(
        default_factory=dict
    )  # this step's prompt rows
    # finished pooling requests: a tensor, or a task -> tensor map (a multi-task request)
    pooler_output: dict[str, PoolerResult] = field(default_factory=dict)
