"""The Lark grammar (as llguidance reads it) that makes a model call a tool: ``tool_choice``
"required" (any of the tools) or one named function, written in the model's own format."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cenote.assistant.tool_parsers import HERMES, JSON_LIST, LLAMA3_JSON, MISTRAL, ToolCallFormat

# between JSON tokens: one space at most, as models write calls on one line (a random or
# confused model cannot fill max_tokens with whitespace)
_WHITESPACE = r"\x20?"


def _call_schema(name: str, parameters: Mapping[str, Any] | None, key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: dict(parameters or {"type": "object"})},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _json(schema: dict[str, Any]) -> str:
    """``%json{...}``: llguidance compiles the schema in place."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": _WHITESPACE}})


def _literal(text: str, special_ids: Mapping[str, int]) -> str:
    """A marker as Lark: a special token by its id (its text never matches plain bytes)."""
    if text in special_ids:
        return f"<[{special_ids[text]}]>"
    return json.dumps(text)


def tool_call_grammar(
    format: ToolCallFormat | None,
    functions: Sequence[tuple[str, Mapping[str, Any] | None]],
    parallel: bool,
    special_ids: Mapping[str, int] | None = None,
) -> str:
    """Calls of ``functions`` ((name, parameters schema) each; one of them for a named
    tool_choice) in ``format`` (None: cenote's JSON list): one call, or one or more when
    ``parallel``."""
    special_ids = special_ids or {}
    format = format or JSON_LIST
    schemas = [_call_schema(name, params, format.arguments_key) for name, params in functions]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if format is HERMES:
        start, end = _literal("<tool_call>", special_ids), _literal("</tool_call>", special_ids)
        calls_rule = 'call ("\\n" call)*' if parallel else "call"
        return f'start: {calls_rule}\ncall: {start} "\\n" {_json(call)} "\\n" {end}\n'
    if format is LLAMA3_JSON:
        calls_rule = 'call ("; " call)*' if parallel else "call"
        return f"start: {calls_rule}\ncall: {_json(call)}\n"
    calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    if format is MISTRAL:
        return f"start: {_literal('[TOOL_CALLS]', special_ids)} {_json(calls)}\n"
    assert format is JSON_LIST, f"a grammar for every tool call format, not {format.name}"
    return f"start: {_json(calls)}\n"
