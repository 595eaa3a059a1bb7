"""Exceptions raised at the edge; the server maps them to HTTP status codes in one place."""

from __future__ import annotations


class CenoteError(Exception):
    """Base class of cenote's own errors."""


class InvalidInputError(CenoteError, ValueError):
    """A request the engine cannot serve as given (too long, bad ids, bad options)."""


class UnsupportedTaskError(InvalidInputError):
    """The model does not support the requested task."""


class UnknownArchitectureError(CenoteError, ValueError):
    """A model folder names an architecture that is not in the registry."""


class EngineDeadError(CenoteError, RuntimeError):
    """The engine core stopped; no more requests can be served."""
