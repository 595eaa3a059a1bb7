"""Every error the server answers, in one place, as OpenAI-style bodies.

``{"error": {"message", "type", "param", "code"}}``; the status code says what went wrong.
text-embeddings-inference's routes answer TEI's ``{"error", "error_type"}`` instead
(``tei_error_response``).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Literal, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from cenote.errors import CenoteError, EngineDeadError, InvalidInputError, RequestFailedError

logger = logging.getLogger(__name__)


# OpenAI's error ``type`` for each status (never an HTTP phrase)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    424: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with its HTTP status; raised by routes and middleware. Its OpenAI ``type`` is
    the status's (``ERROR_TYPES``)."""

    status: int = 400

    def __init__(
        self, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers

    @property
    def type(self) -> str:
        return ERROR_TYPES[self.status]


def _status_error(name: str, status: int) -> type[APIError]:
    """The APIError subclass ``name`` that answers ``status``."""
    doc = f"An APIError answered with status {status} ({ERROR_TYPES[status]})."
    attributes = {"status": status, "__doc__": doc, "__module__": __name__}
    return cast("type[APIError]", type(name, (APIError,), attributes))


BadRequest = _status_error("BadRequest", 400)
Unauthorized = _status_error("Unauthorized", 401)
ModelNotFound = _status_error("ModelNotFound", 404)
Conflict = _status_error("Conflict", 409)
PayloadTooLarge = _status_error("PayloadTooLarge", 413)
Overloaded = _status_error("Overloaded", 429)
Unavailable = _status_error("Unavailable", 503)
# text-embeddings-inference's own errors: an empty batch, a route the served model cannot serve
EmptyBatch = _status_error("EmptyBatch", 400)
WrongModelType = _status_error("WrongModelType", 424)


class BodyError(StarletteHTTPException):
    """A request body that cannot be read (not JSON, not UTF-8, too large, too deep). An HTTP
    exception, so FastAPI passes it through while it reads the body; answered like an APIError."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status_code=status, detail=message)


class ErrorDetail(BaseModel):
    message: str  # what went wrong, with the numbers
    type: str  # invalid_request_error | authentication_error | not_found_error | ...
    param: str | None = None  # the request field at fault, when there is one
    code: int  # the HTTP status


class ErrorResponse(BaseModel):
    """The body of every error answer (OpenAI's shape)."""

    error: ErrorDetail


class TEIErrorResponse(BaseModel):
    """The body of every error of text-embeddings-inference's routes (TEI's shape)."""

    error: str  # what went wrong, with the numbers
    error_type: Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]


_STATUS_DESCRIPTIONS = {
    400: "Invalid request: bad JSON, a wrong or unknown field, or input the model cannot take",
    401: "Missing or wrong API key",
    404: "Unknown model",
    409: "The model is not in a state that allows it (e.g. unloading a model that is not loaded)",
    413: "Request body too large",
    429: "Overloaded: retry after the Retry-After header's seconds",
    500: "A bug: a request that failed inside the engine, or an internal error (with an id "
    "naming its traceback in the server log)",
    503: "The engine is starting or not running (a core died): retry after Retry-After",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries for the error statuses a route can answer."""
    chosen = statuses or tuple(_STATUS_DESCRIPTIONS)
    return {
        status: {"model": ErrorResponse, "description": _STATUS_DESCRIPTIONS[status]}
        for status in chosen
    }


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def api_error_response(error: APIError) -> JSONResponse:
    return error_response(error.status, error.message, error.type, error.param, error.headers)


# TEI's error_type of each status it answers (its ErrorType -> StatusCode mapping)
_TEI_ERROR_TYPES = {424: "Backend", 429: "Overloaded", 500: "Backend", 503: "Unhealthy"}


def tei_error_response(error: Exception) -> JSONResponse:
    """Any error of a text-embeddings-inference route in TEI's shape and statuses: invalid input
    is 422 ``Validation`` (cenote's 400 elsewhere), an empty batch or an unreadable body 400,
    a model that cannot serve the route 424 ``Backend``, overload 429, a starting or dead engine
    503 ``Unhealthy``; a bug stays a 500 (its traceback logged under an id)."""
    headers = None
    if isinstance(error, APIError):
        status, message, headers = error.status, error.message, error.headers
    elif isinstance(error, RequestValidationError):
        status, message = 422, _validation_message(error)[0]
    elif isinstance(error, StarletteHTTPException):  # BodyError: not JSON, too large, too deep
        status, message = error.status_code, str(error.detail)
    else:
        status, message, _type, _param = describe_error(error)
        if status == 503:
            headers = {"Retry-After": "1"}
    if status == 400 and not isinstance(error, (EmptyBatch, StarletteHTTPException)):
        status = 422  # TEI answers invalid input 422 and keeps 400 for empty batches
    error_type = _TEI_ERROR_TYPES.get(status, "Validation")
    if isinstance(error, EmptyBatch):
        error_type = "Empty"
    body = {"error": message, "error_type": error_type}
    return JSONResponse(body, status_code=status, headers=headers)


_UNION_TAG = re.compile(r"^([A-Za-z_]+\[.*\]|str|int|float|bool|none|[A-Z]\w*|function-\w+.*)$")


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per field at fault, and the first field (OpenAI's ``param``).

    Union alternatives are folded into one line per field; unknown fields are named."""
    lines: dict[str, str] = {}
    alternatives: dict[str, list[str]] = {}  # union forms tried, per field
    param = None
    for item in error.errors():
        loc = [p for p in item.get("loc", ()) if p != "body"]
        if item.get("type") == "json_invalid":
            detail = (item.get("ctx") or {}).get("error", "")
            return f"the request body is not valid JSON: {detail}", None
        path = ".".join(str(p) for p in loc if not _UNION_TAG.match(str(p)))
        tags = [str(p) for p in loc if _UNION_TAG.match(str(p))]
        param = param or (str(loc[0]) if loc else None)
        if tags and path in lines:  # another alternative of a union failed too
            forms = alternatives.setdefault(path, [])
            forms.append(tags[0])
            lines[path] = f"{path}: got {item.get('input')!r:.80}, expected one of: " + ", ".join(
                dict.fromkeys(forms)
            )
            continue
        if tags:
            alternatives[path] = [tags[0]]
        if item.get("type") == "extra_forbidden":
            message = f"unknown field {path!r}: cenote does not implement it"
        elif item.get("type") == "missing":
            message = f"{path}: the field is required"
        else:
            message = f"{path or 'body'}: {item.get('msg')}"
            if "input" in item and not isinstance(item["input"], dict | list):
                message += f" (got {item['input']!r:.80})"
        lines.setdefault(path, message)
    return "; ".join(lines.values()) or "invalid request body", param


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to its status and body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return api_error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _schema_error(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)  # 400, as OpenAI and vLLM answer
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(CenoteError)
    async def _cenote_error(_: Request, error: CenoteError) -> JSONResponse:
        return cenote_error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        status = error.status_code
        message = str(error.detail or HTTPStatus(status).phrase)
        if status == 404 and not isinstance(error, BodyError):
            message = "no such route; see /docs or /openapi.json for the routes"
        elif status == 405:
            allowed = (error.headers or {}).get("Allow", "")
            message = f"method not allowed on this route; allowed: {allowed}"
        type_ = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return error_response(status, message, type_, headers=error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        status, message, type_, _param = describe_error(error)
        return error_response(status, message, type_)


def cenote_error_response(error: CenoteError) -> JSONResponse:
    status, message, type_, param = describe_error(error)
    headers = {"Retry-After": "1"} if status == 503 else None
    return error_response(status, message, type_, param, headers)


def describe_error(error: Exception) -> tuple[int, str, str, str | None]:
    """(status, message, OpenAI type, param) of an error a request raised — also for one that
    ends a stream. cenote's own errors map to their status on purpose: the client's mistakes
    are 400 (with the field at fault when known), a gone engine is 503 (retry later or
    elsewhere), a request that failed inside a working engine is 500 naming it (the core
    logged its traceback); anything else is a bug (500, its traceback logged under an id)."""
    if isinstance(error, InvalidInputError):  # incl. unsupported tasks and refused requests
        return 400, str(error), "invalid_request_error", error.param
    if isinstance(error, EngineDeadError):
        return 503, f"engine error: {error}", "service_unavailable", None
    if isinstance(error, RequestFailedError):
        logger.error("%s", error)
        return 500, str(error), "internal_server_error", None
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s", error_id, exc_info=error)
    message = f"internal error: {type(error).__name__} (error id {error_id}, in the server log)"
    return 500, message, "internal_server_error", None
