"""Every error the server answers, in one place, as OpenAI-style bodies.

``{"error": {"message", "type", "param", "code"}}``; the status code says what went wrong.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cenote.errors import EngineDeadError, InvalidInputError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with its HTTP status; raised by routes and middleware."""

    status: int = 400
    type: str = "invalid_request_error"

    def __init__(
        self, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers


class BadRequest(APIError):
    status, type = 400, "invalid_request_error"


class Unauthorized(APIError):
    status, type = 401, "authentication_error"


class ModelNotFound(APIError):
    status, type = 404, "not_found_error"


class PayloadTooLarge(APIError):
    status, type = 413, "invalid_request_error"


class Overloaded(APIError):
    status, type = 429, "rate_limit_error"


class Unavailable(APIError):
    status, type = 503, "service_unavailable"


class EngineFailed(APIError):
    status, type = 500, "internal_server_error"


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def api_error_response(error: APIError) -> JSONResponse:
    return error_response(error.status, error.message, error.type, error.param, error.headers)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for item in error.errors():
        location = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        param = param or location or None
        parts.append(f"{location or 'body'}: {item.get('msg')}")
    return "; ".join(parts) or "invalid request body", param


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to its status and body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return api_error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _schema_error(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(422, message, "invalid_request_error", param)

    @app.exception_handler(InvalidInputError)
    async def _invalid_input(_: Request, error: InvalidInputError) -> JSONResponse:
        return error_response(400, str(error), "invalid_request_error")

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, error: ValueError) -> JSONResponse:
        return error_response(400, str(error), "invalid_request_error")

    @app.exception_handler(TypeError)
    async def _type_error(_: Request, error: TypeError) -> JSONResponse:
        return error_response(400, str(error), "invalid_request_error")

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return error_response(500, f"engine error: {error}", "internal_server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(error.status_code).phrase
        return error_response(error.status_code, str(error.detail or phrase), phrase)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return error_response(500, f"internal error: {type(error).__name__}", "internal_error")
