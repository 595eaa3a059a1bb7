"""What users get back: vLLM-shaped request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch


@dataclass
class PoolingOutput:
    """The pooled tensor of one request."""

    data: torch.Tensor  # [hidden] for sequence tasks, [num_tokens, hidden] for token tasks


@dataclass
class EmbeddingOutput(PoolingOutput):
    """An embedding; ``embedding`` is the list form of ``data``."""

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        return int(self.data.shape[-1])


@dataclass
class ClassificationOutput(PoolingOutput):
    """Class probabilities (or raw scores when the activation is off)."""

    label_names: tuple[str, ...] | None = None  # id2label of the model, in label order

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def num_classes(self) -> int:
        return int(self.data.shape[-1])

    @property
    def label(self) -> str | int:
        """The most likely class: its name when the model has id2label, else its index."""
        index = int(self.data.argmax(-1))
        return self.label_names[index] if self.label_names is not None else index


@dataclass
class SparseEmbeddingOutput(PoolingOutput):
    """A sparse (SPLADE) embedding: ``data`` is the ``[vocab_size]`` weight vector, zero outside
    the active entries; those as (token id, weight) pairs, largest weight first."""

    tokens: list[str] | None = None  # decoded ``token_ids``, when asked for

    def _order(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.data.nonzero().flatten()  # ascending ids
        weights = self.data[ids]
        order = torch.argsort(weights, descending=True, stable=True)
        return ids[order], weights[order]

    @property
    def token_ids(self) -> list[int]:
        return self._order()[0].tolist()

    @property
    def weights(self) -> list[float]:
        return self._order()[1].tolist()

    @property
    def pairs(self) -> list[tuple[int, float]]:
        ids, weights = self._order()
        return list(zip(ids.tolist(), weights.tolist(), strict=True))

    @property
    def num_active(self) -> int:
        return int(torch.count_nonzero(self.data))

    def to_sparse(self) -> torch.Tensor:
        """The sparse COO form, as sentence-transformers' SparseEncoder returns it."""
        return self.data.to_sparse()


@dataclass
class MultiTaskOutput:
    """The results of one request that asked several pooling tasks of one trunk pass (BGE-M3's
    dense ``embed``, lexical ``embed_sparse`` and ColBERT ``token_embed`` at once), by task;
    each is the output the task gives alone (``out.outputs["embed"].data``)."""

    by_task: dict[str, PoolingOutput]  # in the order the tasks were asked

    def __getitem__(self, task: str) -> PoolingOutput:
        return self.by_task[task]

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.by_task)


@dataclass(frozen=True)
class SpecDecodeMetrics:
    """Speculative decoding of one engine since it started (``LLM.spec_decode_metrics()``;
    the server's ``cenote_spec_decode_num_{draft,accepted}_tokens_total``)."""

    num_draft_tokens: int  # tokens drafted and verified
    num_accepted_tokens: int  # of those, kept: the model produced them too

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class ScoringOutput:
    """One similarity or relevance score."""

    score: float
    chunk_index: int | None = None  # chunk-and-max reranking: the best window of the document


T = TypeVar("T")


@dataclass
class PoolingRequestOutput(Generic[T]):
    """The result of one pooling request, in the order the prompts were given."""

    request_id: str
    outputs: T  # PoolingOutput or a task-specific subclass
    prompt_token_ids: list[int]
    finished: bool = True
    # seconds in the engine core: ``queue_time`` (taken -> first scheduled) and
    # ``inference_time`` (first scheduled -> finished); see ``RequestOutput.metrics``
    metrics: dict[str, float] = field(default_factory=dict)


EmbeddingRequestOutput = PoolingRequestOutput
ClassificationRequestOutput = PoolingRequestOutput
ScoringRequestOutput = PoolingRequestOutput


@dataclass
class Logprob:
    """Log-probability of one token."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]  # None for the first prompt token


@dataclass(frozen=True)
class FunctionCall:
    """The function a tool call names, and its arguments."""

    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from a chat completion's text (``cenote.assistant``)."""

    id: str  # "call_" + 24 hex digits, unique per call
    function: FunctionCall
    type: str = "function"


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a generation request."""

    index: int  # which of the n completions
    text: str  # generated text (stop strings trimmed)
    token_ids: list[int]  # generated token ids
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token that ended it
    # chat with tools (LLM.chat): the calls parsed from ``text``; None when not parsed
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # chat with a reasoning parser: the thinking

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one generation request, or an update of it while it runs: everything so
    far (``RequestOutputKind.CUMULATIVE``), or only what is new (``DELTA``: ``outputs`` lists
    the completions with new text or a finish, their new text, tokens and logprobs)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generated_tokens: int = 0  # tokens generated so far, all completions (also in DELTA)
    # ``first_token_time``: time.monotonic() of the first token's arrival (this process);
    # once finished, seconds in the engine core: ``queue_time`` (the core took it -> first
    # scheduled) and ``inference_time`` (first scheduled -> finished). With several engine
    # requests (n completions, windows of a long input): queue_time is the shortest wait and
    # queue_time + inference_time the longest time one of them spent in the core, so their
    # sum never exceeds the request's time in the engine.
    metrics: dict[str, float] = field(default_factory=dict)
