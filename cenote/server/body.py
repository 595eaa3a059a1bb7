"""Request bodies read strictly: every way a body can be unreadable is a 400 that says why.

Routes are ``JSONRoute``s: FastAPI reads the body through ``StrictJSONRequest.json``, which
refuses invalid UTF-8, invalid JSON (with line and column, not a byte offset), NaN/Infinity,
nesting beyond ``MAX_DEPTH``, a key twice in one object and lone surrogates; big bodies are parsed off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from cenote.server.errors import BodyError, tei_error_response

B = TypeVar("B", bound=BaseModel)

MAX_DEPTH = 64  # nesting of JSON arrays / objects a request may use
_OFF_LOOP_BYTES = 1 << 18  # parse bodies larger than this in a worker thread
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _no_constant(name: str) -> Any:
    raise BodyError(400, f"the request body contains {name}, which is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose names are unique (a repeated one would silently lose a value)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BodyError(
                    400, f"the request body has the key {key!r:.60} twice in one object"
                )
            seen.add(key)
    return value


def parse_json(body: bytes) -> Any:
    """The parsed body, or ``BodyError(400)`` naming what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(
            400, f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})"
        ) from None
    try:
        value = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        message = f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        raise BodyError(400, message) from None
    except RecursionError:
        raise BodyError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    if _depth(value) > MAX_DEPTH:
        raise BodyError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(body):
        _check_unicode(value)
    return value


def _depth(value: Any) -> int:
    """Nesting depth of arrays / objects, iteratively (scalars: 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            return depth
        stack.extend((child, depth + 1) for child in item if isinstance(child, dict | list))
    return deepest


def _check_unicode(value: Any) -> None:
    """Strings with an unpaired surrogate (``"\\ud800"``) cannot be tokenized: refuse them."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                bad = item[e.start]
                raise BodyError(
                    400,
                    f"the request body has a lone surrogate (\\u{ord(bad):04x}) in a string; "
                    "send valid Unicode (a surrogate must be half of a pair)",
                ) from None


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > _OFF_LOOP_BYTES:
                self._json = await asyncio.to_thread(parse_json, body)
            else:
                self._json = parse_json(body)
        return self._json


class JSONRoute(APIRoute):
    """An APIRoute whose body is read by ``StrictJSONRequest``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler


class TEIRoute(JSONRoute):
    """A JSONRoute of text-embeddings-inference's API: every error, the body's validation
    included, is answered in TEI's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def tei_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as error:
                return tei_error_response(error)

        return tei_handler


async def answer_tei(
    raw_request: Request,
    model: type[B],
    handler: Callable[..., Awaitable[Response]],
) -> Response:
    """A TEI body on a path another API shares (``/rerank``, ``/tokenize``): validated as
    ``model`` and answered by ``handler(body, raw_request=...)``, every error in TEI's
    shape."""
    try:
        try:
            body = model.model_validate(await raw_request.json())
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        return await handler(body, raw_request=raw_request)
    except Exception as error:
        return tei_error_response(error)
