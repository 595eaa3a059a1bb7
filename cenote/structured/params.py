"""What a request's output must match (vLLM's ``StructuredOutputsParams`` fields), and the
llguidance grammar that says it.

Exactly one constraint per request: ``json`` (a JSON schema, as a dict or its text),
``json_object`` (any JSON object), ``regex``, ``choice`` (one of the strings, verbatim) or
``grammar`` (Lark, as llguidance reads it, or GBNF / EBNF with ``::=`` rules, as llama.cpp and
xgrammar read it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark

from cenote.errors import InvalidInputError

# the bound on one constraint's text: a schema, a regex or a grammar (a choice list: its total)
MAX_CONSTRAINT_CHARS = 1 << 18  # checked on a front thread: ~60 ms of GIL per 256 KiB of schema

# between JSON tokens: pretty-printed output fits (a newline and its indentation), but a model
# cannot fill max_tokens with one gap of whitespace, as unbounded patterns let it
_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """One request's output constraint; checked (its grammar compiled once, without a
    tokenizer) on construction, so a bad schema is refused before the engine sees it."""

    json: str | dict[str, Any] | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF / EBNF (rules written ``name ::= ...``)
    json_object: bool | None = None  # any JSON object
    whitespace_pattern: str | None = None  # a regex for the whitespace between JSON tokens
    disable_additional_properties: bool = False  # objects without "additionalProperties" close

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # canonical text: the compile cache keys on it
            self.json = json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidInputError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {len(given)}" + (f" ({', '.join(given)})" if given else "")
            )
        size = self._size()
        if size > MAX_CONSTRAINT_CHARS:
            raise InvalidInputError(
                f"structured outputs: the {self.kind} has {size} characters, at most "
                f"{MAX_CONSTRAINT_CHARS} are allowed"
            )
        if self.kind == "choice" and not self.choice:
            raise InvalidInputError("structured outputs: choice must list at least one string")
        error = checked_grammar(self.to_grammar())
        if error:
            raise InvalidInputError(f"structured outputs: the {self.kind} is invalid: {error}")

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def _size(self) -> int:
        if self.choice is not None:
            return sum(len(c) for c in self.choice)
        value = getattr(self, self.kind)
        return len(value) if isinstance(value, str) else 0

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint."""
        return _grammar(
            self.kind,
            self.json if isinstance(self.json, str) else None,
            self.regex,
            tuple(self.choice) if self.choice is not None else None,
            self.grammar,
            self.whitespace_pattern,
            self.disable_additional_properties,
        )


@lru_cache(maxsize=256)
def _grammar(
    kind: str,
    schema: str | None,
    regex: str | None,
    choice: tuple[str, ...] | None,
    grammar: str | None,
    whitespace_pattern: str | None,
    disable_additional_properties: bool,
) -> str:
    if kind in ("json", "json_object"):
        try:
            loaded = json.loads(schema) if schema is not None else {"type": "object"}
        except ValueError as e:
            raise InvalidInputError(f"structured outputs: json is not valid JSON: {e}") from e
        if isinstance(loaded, bool):  # the schemas true and false: anything, nothing
            loaded = {} if loaded else {"not": {}}
        if not isinstance(loaded, dict):
            raise InvalidInputError(
                f"structured outputs: json must be a JSON schema object, got "
                f"{type(loaded).__name__}"
            )
        options: dict[str, Any] = (
            {"whitespace_flexible": False}  # "": no whitespace between JSON tokens
            if whitespace_pattern == ""
            else {"whitespace_pattern": whitespace_pattern or _JSON_WHITESPACE}
        )
        if disable_additional_properties:
            options["coerce_one_of"] = True
        defaults: Any = options
        if disable_additional_properties:
            loaded = _close_objects(loaded)
        try:
            return LLMatcher.grammar_from_json_schema(loaded, defaults=defaults)
        except ValueError as e:
            raise InvalidInputError(f"structured outputs: the json schema is invalid: {e}") from e
    if kind == "regex":
        assert regex is not None
        return LLMatcher.grammar_from_regex(regex)
    if kind == "choice":
        assert choice is not None
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in choice))
    assert grammar is not None
    try:
        lark = gbnf_to_lark(grammar) if "::=" in grammar else grammar
    except Exception as e:  # the converter raises bare Exceptions on user errors
        raise InvalidInputError(f"structured outputs: the GBNF grammar is invalid: {e}") from e
    return LLMatcher.grammar_from_lark(lark)


def _close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not say."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: _close_objects(v) for k, v in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and (
        "additionalProperties" not in closed
    ):
        closed["additionalProperties"] = False
    return closed


@lru_cache(maxsize=256)
def checked_grammar(grammar: str) -> str:
    """The grammar's first error (unsupported keyword, syntax error), or "" when it compiles."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else ""
