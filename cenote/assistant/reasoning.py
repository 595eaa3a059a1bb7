"""Reasoning in a chat completion's text: the ``<think>...</think>`` part of models that think
before they answer, split from the answer whole or as the text streams."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import Tokenizer

from cenote.assistant.markers import could_open, partial_marker
from cenote.sampling_params import SamplingParams


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


def thinking_turned_off(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a request turned its model's thinking off through the template's variables
    (``enable_thinking``: Qwen3; ``thinking``: DeepSeek-V3.1, Granite)."""
    kwargs = chat_template_kwargs or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False


def request_reasoning(
    format: ReasoningFormat | None, chat_template_kwargs: Mapping[str, Any] | None
) -> ReasoningFormat | None:
    """The reasoning format one chat request is read with: none once it turned thinking off
    (the template closed the thinking in the prompt, so the whole output is the answer; a
    format whose thinking the template opens would otherwise call all of it reasoning)."""
    return None if thinking_turned_off(chat_template_kwargs) else format


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


def constrain_after_thinking(
    params: SamplingParams,
    format: ReasoningFormat | None,
    tokenizer: Tokenizer,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> SamplingParams:
    """``params`` whose output constraint starts after the thinking (the tokens of the end
    marker), so a reasoning model thinks freely and its answer is constrained; unchanged
    without a reasoning format, a constraint, a one-token end marker in the vocabulary, or with
    thinking turned off in the template."""
    constraint = params.structured_outputs
    if format is None or constraint is None or constraint.start_after_token_ids is not None:
        return params
    if thinking_turned_off(chat_template_kwargs):
        return params
    end = tokenizer.encode(format.end, add_special_tokens=False).ids
    # reasoning models have the marker as one token; bytes of it (or an unknown token) are no end
    if len(end) != 1 or tokenizer.decode(end, skip_special_tokens=False) != format.end:
        return params
    after = dataclasses.replace(constraint, start_after_token_ids=end)
    return dataclasses.replace(params, structured_outputs=after)
