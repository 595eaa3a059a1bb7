"""Exceptions raised at the edge; the server maps them to HTTP status codes in one place."""

from __future__ import annotations


class CenoteError(Exception):
    """Base class of cenote's own errors."""


class InvalidInputError(CenoteError, ValueError):
    """A request the engine cannot serve as given (too long, bad ids, bad options). ``param``:
    the request field at fault, when one is (the server reports it)."""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class InvalidInputTypeError(InvalidInputError, TypeError):
    """A request field of the wrong type (a ``TypeError`` too, as Python callers expect)."""


class UnsupportedTaskError(InvalidInputError):
    """The model does not support the requested task."""


class UnknownArchitectureError(CenoteError, ValueError):
    """A model folder names an architecture that is not in the registry."""


class EngineDeadError(CenoteError, RuntimeError):
    """The engine core stopped; no more requests can be served."""


class RequestRejectedError(InvalidInputError):
    """The engine core refused to add a request as given (a ``ValueError`` of
    ``EngineCore.add_request``, e.g. a request id already in the engine)."""


class RequestFailedError(CenoteError, RuntimeError):
    """A request failed inside the engine (a bug, not the client's input); the engine goes on."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
