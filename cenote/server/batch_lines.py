"""OpenAI batch files: one request a line in, one result a line out.

In:  ``{"custom_id": str, "method": "POST", "url": "/v1/embeddings", "body": {...}}``
Out: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``; a
line that fails gets its status code, an OpenAI error body and ``error: {code, message}``.
Bodies are the server's request models (``cenote.server.protocol``), so a batch line accepts
exactly what the HTTP route accepts.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel, ValidationError

from cenote.errors import CenoteError, InvalidInputError
from cenote.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)

BODY_MODELS: dict[str, type[BaseModel]] = {
    "/v1/embeddings": EmbeddingRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/score": ScoreRequest,
    "/v1/rerank": RerankRequest,
}


class LineError(CenoteError):
    """A batch line that cannot be run; ``status`` is the HTTP status the route would answer."""

    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.type = message, status, type_


@dataclass
class BatchLine:
    """One parsed input line."""

    number: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: BaseModel  # the route's request model


def parse_line(number: int, raw: bytes) -> BatchLine:
    """Validate the envelope and the body of line ``number``; raises ``LineError``."""
    if not raw.strip():
        raise LineError(f"line {number} is empty; every line must hold one request")
    try:
        record = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise LineError(f"line {number} is not valid JSON: {e}") from e
    except RecursionError as e:  # msgspec's bound on nesting, about 1,000 levels
        raise LineError(f"line {number} nests JSON too deeply to parse ({e})") from e
    if not isinstance(record, dict):
        raise LineError(f"line {number} is a JSON {type(record).__name__}, not an object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(f"line {number}: custom_id must be a non-empty string")
    method, url = record.get("method", "POST"), record.get("url")
    if method != "POST":
        raise LineError(f"line {number}: method must be POST, got {method!r}")
    if url not in BODY_MODELS:
        raise LineError(
            f"line {number}: unknown url {url!r}; cenote run-batch serves {', '.join(BODY_MODELS)}",
            status=404,
            type_="not_found_error",
        )
    body = record.get("body")
    if not isinstance(body, dict):
        raise LineError(f"line {number}: body must be a JSON object")
    try:
        model = BODY_MODELS[url].model_validate(body)
    except ValidationError as e:
        raise LineError(f"line {number}: {_validation_message(e)}", status=422) from e
    return BatchLine(number, custom_id, url, model)


class _Envelope(msgspec.Struct):
    custom_id: Any = None  # the other fields are skipped, not built


_ENVELOPE = msgspec.json.Decoder(_Envelope)


def custom_id_of(raw: bytes) -> str | None:
    """The line's custom_id when it has a non-empty one, whatever else is wrong with it; never
    raises (it names the lines that failed)."""
    try:
        custom_id = _ENVELOPE.decode(raw).custom_id
    except (msgspec.DecodeError, RecursionError):
        return None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def error_of(line_number: int, error: Exception) -> LineError:
    """The status and message a failed line reports (the server's mapping: the input's fault
    is 400, anything else a 500 naming the error)."""
    if isinstance(error, LineError):
        return error
    if isinstance(error, InvalidInputError):
        return LineError(f"line {line_number}: {error}")
    return LineError(
        f"line {line_number}: internal error: {type(error).__name__}: {error}",
        status=500,
        type_="internal_server_error",
    )


def success_line(custom_id: str, body: dict[str, Any] | msgspec.Raw) -> dict[str, Any]:
    """``body``: the answer, or its JSON encoded already (``msgspec.Raw``)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"batch-{uuid.uuid4().hex}", "body": body},
        "error": None,
    }


def error_line(custom_id: str | None, error: LineError) -> dict[str, Any]:
    body = {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": None,
            "code": error.status,
        }
    }
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": error.status,
            "request_id": f"batch-{uuid.uuid4().hex}",
            "body": body,
        },
        "error": {"code": error.type, "message": error.message},
    }


def _validation_message(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        location = ".".join(str(p) for p in item.get("loc", ()))
        parts.append(f"body.{location}: {item.get('msg')}" if location else str(item.get("msg")))
    return "; ".join(parts) or "invalid request body"
