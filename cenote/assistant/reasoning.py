"""Reasoning in a chat completion's text: the ``<think>...</think>`` part of models that think
before they answer, split from the answer whole or as the text streams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cenote.assistant.markers import could_open, partial_marker


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model family marks its thinking."""

    name: str
    # the output may begin inside the thinking (the template opened it): all is thinking until
    # the end marker; otherwise thinking only when the output opens with the start marker
    opened_by_template: bool
    start: str = "<think>"
    end: str = "</think>"


REASONING_FORMATS = {
    f.name: f
    for f in (
        ReasoningFormat("qwen3", opened_by_template=False),
        ReasoningFormat("deepseek_r1", opened_by_template=True),
    )
}


def reasoning_format(parser: str | None) -> ReasoningFormat | None:
    """The format named by ``--reasoning-parser`` (None or "none": no reasoning parsing)."""
    if parser in (None, "none"):
        return None
    if parser not in REASONING_FORMATS:
        raise ValueError(
            f"unknown reasoning parser {parser!r}; the parsers are none, "
            + ", ".join(REASONING_FORMATS)
        )
    return REASONING_FORMATS[parser]


class ReasoningStream:
    """Splits streamed text into (reasoning, content) deltas; the end marker may be split
    across deltas and is held back, never shown."""

    def __init__(self, format: ReasoningFormat) -> None:
        self.format = format
        self._buffer = ""
        self._state: Literal["opening", "reasoning", "content"] = "opening"

    def feed(self, delta: str) -> tuple[str, str]:
        self._buffer += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        start, end = self.format.start, self.format.end
        if self._state == "opening":
            stripped = self._buffer.lstrip()
            if stripped.startswith(start):
                self._state, self._buffer = "reasoning", stripped[len(start) :]
            elif not final and (not stripped or could_open(stripped, (start,))):
                return "", ""
            else:
                self._state = "reasoning" if self.format.opened_by_template else "content"
        reasoning = ""
        if self._state == "reasoning":
            position = self._buffer.find(end)
            if position >= 0:
                reasoning, self._buffer = (
                    self._buffer[:position],
                    self._buffer[position + len(end) :],
                )
                self._state = "content"
            else:
                held = 0 if final else partial_marker(self._buffer, (end,))
                cut = len(self._buffer) - held
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
        content, self._buffer = self._buffer, ""
        return reasoning, content
