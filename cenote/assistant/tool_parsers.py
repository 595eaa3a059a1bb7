"""Tool calls in a chat completion's text: the formats models write them in (hermes, llama3_json,
mistral, and cenote's plain JSON for forced calls), parsed whole or as the text streams.

One parser, ``ToolCallStream``, serves both: the whole text is one delta. A block of calls is
decided only once it is complete (its end marker, or the end of the output), so what streams out
never has to be taken back: a block that does not hold valid calls is content, verbatim. Content
is held back while it may be the start of a marker, and whitespace right before a call (or after
the last one) is dropped, so concatenated deltas equal the whole answer on any split.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cenote.assistant.markers import could_open, find_marker, partial_marker
from cenote.outputs import FunctionCall, ToolCall

# (name, arguments) of each call in a block, or None when the block holds no valid calls
BlockParser = Callable[[str], list[tuple[str, dict[str, Any]]] | None]
ToolEvent = str | ToolCall  # content text, or one whole tool call


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model family writes tool calls."""

    name: str
    starts: tuple[str, ...]  # markers that open a block of calls
    end: str | None  # the marker that closes a block; None: it runs to the end of the output
    parse: BlockParser  # the block's text (after its start marker) -> its calls
    opens_output: bool = False  # a block only opens the output (after whitespace)
    kept_starts: tuple[str, ...] = ()  # start markers that are the block's first character
    keeps_special_tokens: bool = False  # the markers are special tokens: keep them in the text
    arguments_key: str = "arguments"  # what the model calls the arguments (grammars write it)


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def _calls(objects: list[Any]) -> list[tuple[str, dict[str, Any]]] | None:
    """Objects ``{"name": ..., "arguments" | "parameters": {...}}`` as calls (all or none)."""
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append((obj["name"], arguments))
    return calls or None


def _one_object(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    try:
        return _calls([_loads(text.strip())])
    except ValueError:
        return None


def _object_or_list(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    try:
        loaded = _loads(text.strip())
    except ValueError:
        return None
    return _calls(loaded if isinstance(loaded, list) else [loaded])


def _semicolon_objects(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """``{...}; {...}``: Llama 3's parallel calls."""
    decoder, objects, position, text = json.JSONDecoder(), [], 0, text.strip()
    decoder.parse_constant = _reject_constant
    while True:
        try:
            obj, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        objects.append(obj)
        position = len(text) - len(text[position:].lstrip())
        if position == len(text):
            return _calls(objects)
        if text[position] != ";":
            return None
        position = len(text) - len(text[position + 1 :].lstrip())


HERMES = ToolCallFormat("hermes", ("<tool_call>",), "</tool_call>", _one_object)
LLAMA3_JSON = ToolCallFormat(
    "llama3_json", ("<|python_tag|>", "{"), None, _semicolon_objects, opens_output=True,
    kept_starts=("{",), arguments_key="parameters",
)  # fmt: skip
MISTRAL = ToolCallFormat(
    "mistral", ("[TOOL_CALLS]",), None, _object_or_list, keeps_special_tokens=True
)
# cenote's own, for tool_choice required / named on a template without a known format
JSON_LIST = ToolCallFormat(
    "json", ("[",), None, _object_or_list, opens_output=True, kept_starts=("[",)
)

TOOL_CALL_FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
# what a chat template says -> the format its model writes (first match wins)
_TEMPLATE_SIGNS = (("<tool_call>", HERMES), ("[TOOL_CALLS]", MISTRAL),
                   ("<|python_tag|>", LLAMA3_JSON), ("ipython", LLAMA3_JSON))  # fmt: skip


def tool_call_format(parser: str, template: str | None) -> ToolCallFormat | None:
    """The format named by ``--tool-call-parser``: "auto" reads it from the chat template (None
    when the template shows none), "none" parses nothing."""
    if parser == "none":
        return None
    if parser == "auto":
        return next((f for sign, f in _TEMPLATE_SIGNS if template and sign in template), None)
    if parser not in TOOL_CALL_FORMATS:
        raise ValueError(
            f"unknown tool call parser {parser!r}; the parsers are auto, none, "
            + ", ".join(TOOL_CALL_FORMATS)
        )
    return TOOL_CALL_FORMATS[parser]


class ToolCallStream:
    """Splits streamed text into content and tool calls (see the module docstring)."""

    def __init__(
        self,
        format: ToolCallFormat,
        new_id: Callable[[], str] = new_tool_call_id,
        max_calls: int | None = None,
    ) -> None:
        self.format = format
        self.new_id = new_id
        self.max_calls = max_calls  # calls past it are dropped (parallel_tool_calls false)
        self.num_calls = 0
        self._buffer = ""  # text not decided yet
        self._held_space = ""  # trailing whitespace of content: dropped if a call follows
        self._marker: str | None = None  # the start marker of the open block
        self._content_started = False  # opens_output formats: content came first, no block

    def feed(self, delta: str) -> list[ToolEvent]:
        self._buffer += delta
        return self._advance(final=False)

    def finish(self) -> list[ToolEvent]:
        """What is left once the output ends: an unclosed block is decided as it stands."""
        events = self._advance(final=True)
        if self._held_space and self.num_calls == 0:
            events.append(self._held_space)
        self._held_space = ""
        return events

    def _advance(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while self._buffer or (final and self._marker is not None):
            if self._marker is not None:
                if not self._close_block(events, final):
                    break
            elif not self._scan_content(events, final):
                break
        return events

    def _close_block(self, events: list[ToolEvent], final: bool) -> bool:
        """Decide the open block once its end is here; False while it is not."""
        assert self._marker is not None
        end = self.format.end
        position = self._buffer.find(end) if end is not None else -1
        if position < 0 and not final:
            return False
        inner = self._buffer if position < 0 else self._buffer[:position]
        closing = "" if position < 0 or end is None else end
        self._buffer = "" if position < 0 else self._buffer[position + len(closing) :]
        marker, self._marker = self._marker, None
        kept = marker if marker in self.format.kept_starts else ""
        calls = self.format.parse(kept + inner)
        if calls is None:  # not calls after all: the block is content, verbatim
            self._content(events, marker + inner + closing)
            return True
        self._held_space = ""
        if self.max_calls is not None:
            calls = calls[: max(0, self.max_calls - self.num_calls)]
        for name, arguments in calls:
            arguments_text = json.dumps(arguments, ensure_ascii=False)
            events.append(ToolCall(self.new_id(), FunctionCall(name, arguments_text)))
            self.num_calls += 1
        return True

    def _scan_content(self, events: list[ToolEvent], final: bool) -> bool:
        """Emit content up to the next block's start marker; False when the rest is held."""
        starts = self.format.starts
        if self.format.opens_output and not self._content_started:
            stripped = self._buffer.lstrip()
            marker = next((m for m in starts if stripped.startswith(m)), None)
            if marker is not None:
                self._held_space += self._buffer[: len(self._buffer) - len(stripped)]
                self._buffer, self._marker = stripped[len(marker) :], marker
                return True
            if not final and (not stripped or could_open(stripped, starts)):
                return False
            self._content_started = True
        if self.format.opens_output:
            self._content(events, self._buffer)
            self._buffer = ""
            return False
        position, marker = find_marker(self._buffer, starts)
        if position >= 0:
            self._content(events, self._buffer[:position])
            self._buffer, self._marker = self._buffer[position + len(marker) :], marker
            return True
        held = 0 if final else partial_marker(self._buffer, starts)
        self._content(events, self._buffer[: len(self._buffer) - held])
        self._buffer = self._buffer[len(self._buffer) - held :]
        return False

    def _content(self, events: list[ToolEvent], text: str) -> None:
        if not text:
            return
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept) :]
        if kept:
            events.append(kept)


def parse_tool_calls(
    format: ToolCallFormat,
    text: str,
    new_id: Callable[[], str] = new_tool_call_id,
    max_calls: int | None = None,
) -> tuple[str | None, list[ToolCall]]:
    """The content (None when empty) and the tool calls of a whole output (the first
    ``max_calls`` of them)."""
    stream = ToolCallStream(format, new_id, max_calls)
    events = stream.feed(text) + stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content or None, [e for e in events if isinstance(e, ToolCall)]
