"""``--log-requests``: one bounded line per API request, written once its response is sent.

The line names the request (the id its response carries), the model and task that answered,
the route, its status, prompt and generated tokens and the latency, and describes the prompt
by its number of inputs and characters only. The text itself appears only when
``--log-requests-max-chars N`` is above 0: the first N characters of the first input, quoted
(newlines and control characters escaped), so a line stays one line and bounded. A client's
``request_id`` is quoted and cut the same way.
"""

from __future__ import annotations

import logging

from cenote.server.timing import RequestTimings

logger = logging.getLogger("cenote.requests")

_MAX_ID_CHARS = 128  # a client's request_id is echoed as given: it is cut in the log line


def log_request(
    method: str,
    route: str,
    status: int,
    seconds: float,
    timings: RequestTimings,
    max_chars: int,
) -> None:
    logger.info("%s", request_line(method, route, status, seconds, timings, max_chars))


def request_line(
    method: str,
    route: str,
    status: int,
    seconds: float,
    timings: RequestTimings,
    max_chars: int,
) -> str:
    """E.g. ``request 'embd-1a2b' model='minilm' method=POST route=/v1/embeddings task=embed
    status=200 prompt_tokens=12 output_tokens=0 latency_ms=8.4 inputs=2 chars=40``
    (``route``: the route's template, as ``cenote_http_requests`` names it)."""
    fields = [
        f"request {_quoted(timings.request_id, _MAX_ID_CHARS)}",
        f"model={timings.model!r}" if timings.model is not None else "model=-",
        f"method={method}",
        f"route={route}",
        f"task={timings.task or '-'}",
        f"status={status}",
        f"prompt_tokens={timings.num_tokens}",
        f"output_tokens={timings.num_output_tokens}",
        f"latency_ms={seconds * 1000:.1f}",
        f"inputs={timings.num_inputs}",
        f"chars={timings.num_characters}",
    ]
    if max_chars > 0 and timings.first_prompt is not None:
        fields.append(f"prompt={_quoted(timings.first_prompt, max_chars)}")
    return " ".join(fields)


def _quoted(text: str | None, limit: int) -> str:
    """``text``'s first ``limit`` characters as a Python literal (one line), ``...`` when cut."""
    if text is None:
        return "-"
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
