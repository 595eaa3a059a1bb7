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
            timings.tokenization_seconds += time.monotonic() - started


def record_requests(requests: Sequence[ParentRequest]) -> None:
    """The characters of the current request's text inputs."""
    timings = current_timings.get()
    if timings is not None:
        timings.num_characters += sum(len(r.prompt) for r in requests if r.prompt is not None)


def record_outputs(metrics: Sequence[dict[str, float]], num_tokens: int, compute_type: str) -> None:
    """The current request's engine durations (one dict per input), prompt tokens, device."""
    timings = current_timings.get()
    if timings is not None:
        timings.record(metrics, num_tokens, compute_type)
