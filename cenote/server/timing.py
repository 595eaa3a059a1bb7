"""Per-phase timing headers, as text-embeddings-inference sends them.

TEI answers every embed, predict and rerank call with ``x-compute-type``, ``x-compute-time``,
``x-compute-characters``, ``x-compute-tokens``, ``x-total-time``, ``x-tokenization-time``,
``x-queue-time`` and ``x-inference-time``; the times are whole milliseconds (truncated),
``x-compute-time`` equals ``x-total-time``, and for a batch of inputs the tokens and characters
are summed and the three phase times averaged over the inputs. cenote sends the same on every
response whose work ran in the engine (pooling, scoring, TEI routes, non-streamed completions):

- total: from the front door taking the request to the response starting (this process);
- tokenization: validating and tokenizing the request (templates included), off the loop;
- queue and inference: measured by the engine core on its own clock (``RequestOutput.metrics``)
  and averaged over the request's inputs, as TEI does; inputs the embedding cache answered
  count as zero;
- tokens: the inputs' prompt tokens (``usage.prompt_tokens``); characters: the inputs' text
  (a chat's rendered template; token-id inputs have none);
- compute type: the device of the model that answered (``cpu``, ``cuda``).

A streamed response starts before any work is done, so it carries no timing headers; neither
does an error, nor a route that never reaches the engine (``/tokenize``, ``/health``).

The same record, read once the response is sent, feeds the per-task metrics, the
``--log-requests`` line and the trace spans (``cenote/server/observe.py``): it also keeps the
model, task, request id and output tokens, and the moments (this process's monotonic clock)
tokenization began and ended and the engine client got the request and gave its last output.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

from cenote.engine.input_processor import ParentRequest


@dataclass
class RequestTimings:
    """What one HTTP request has measured so far (shared by the tasks its handler starts)."""

    started: float = field(default_factory=time.monotonic)
    tokenization_seconds: float = 0.0
    queue_seconds: float = 0.0  # averaged over the inputs
    inference_seconds: float = 0.0
    num_tokens: int = 0
    num_characters: int = 0
    compute_type: str = "cpu"  # where the model that answered runs: "cpu" or "cuda"
    ran: bool = False  # the engine answered: headers are sent
    model: str | None = None  # the served model that answered
    task: str | None = None  # what it ran: embed, classify, score, generate, ...
    request_id: str | None = None  # the id the response carries
    num_inputs: int = 0
    num_output_tokens: int = 0  # generated tokens (generation)
    first_prompt: str | None = None  # the first input's text, when it had one
    tokenization_started: float | None = None  # time.monotonic() of the first tokenization
    tokenization_finished: float | None = None  # ... and the end of the last
    engine_started: float | None = None  # the requests went to the engine client
    engine_finished: float | None = None  # their last output came back
    first_token_time: float | None = None  # the earliest first generated token (generation)

    def record(
        self, metrics: Sequence[dict[str, float]], num_tokens: int, compute_type: str
    ) -> None:
        """The outputs' engine durations (one ``metrics`` dict per input) and prompt tokens."""
        self.compute_type = compute_type
        if metrics:
            self.queue_seconds = sum(m.get("queue_time", 0.0) for m in metrics) / len(metrics)
            self.inference_seconds = sum(m.get("inference_time", 0.0) for m in metrics) / len(
                metrics
            )
            first_tokens = [m["first_token_time"] for m in metrics if "first_token_time" in m]
            if first_tokens:
                self.first_token_time = min(first_tokens)
        self.num_tokens += num_tokens
        self.ran = True

    def headers(self) -> list[tuple[bytes, bytes]]:
        total = _millis(time.monotonic() - self.started)
        values = {
            "x-compute-type": self.compute_type,
            "x-compute-time": total,
            "x-compute-characters": str(self.num_characters),
            "x-compute-tokens": str(self.num_tokens),
            "x-total-time": total,
            "x-tokenization-time": _millis(self.tokenization_seconds),
            "x-queue-time": _millis(self.queue_seconds),
            "x-inference-time": _millis(self.inference_seconds),
        }
        return [(name.encode(), value.encode()) for name, value in values.items()]


def _millis(seconds: float) -> str:
    return str(int(max(seconds, 0.0) * 1000))  # TEI: Duration::as_millis, truncated


current_timings: ContextVar[RequestTimings | None] = ContextVar("current_timings", default=None)


@contextlib.contextmanager
def tokenization() -> Iterator[None]:
    """Count the enclosed time as the current request's tokenization."""
    started = time.monotonic()
    try:
        yield
    finally:
        timings = current_timings.get()
        if timings is not None:
            finished = time.monotonic()
            timings.tokenization_seconds += finished - started
            if timings.tokenization_started is None:
                timings.tokenization_started = started
            timings.tokenization_finished = finished


def record_request_id(request_id: str) -> None:
    """The id the current request's response carries (logs and traces name it)."""
    timings = current_timings.get()
    if timings is not None:
        timings.request_id = request_id


def record_requests(requests: Sequence[ParentRequest]) -> None:
    """The number and characters of the current request's inputs, and its first text."""
    timings = current_timings.get()
    if timings is not None:
        timings.num_inputs += len(requests)
        timings.num_characters += sum(len(r.prompt) for r in requests if r.prompt is not None)
        if timings.first_prompt is None and requests:
            timings.first_prompt = requests[0].prompt


@dataclass(frozen=True)
class EngineRun:
    """What answered the current request and when the engine client had it (monotonic)."""

    model: str  # the served model's name
    task: str  # embed, classify, score, generate, ... (the per-task metrics' label)
    compute_type: str  # the model's device: "cpu" or "cuda"
    started: float  # the requests went to the engine client
    finished: float  # their last output came back
    num_output_tokens: int = 0  # generated tokens


def record_outputs(metrics: Sequence[dict[str, float]], num_tokens: int, run: EngineRun) -> None:
    """The current request's engine durations (one dict per input), prompt tokens and run."""
    timings = current_timings.get()
    if timings is not None:
        timings.record(metrics, num_tokens, run.compute_type)
        timings.model, timings.task = run.model, run.task
        timings.engine_started, timings.engine_finished = run.started, run.finished
        timings.num_output_tokens += run.num_output_tokens
