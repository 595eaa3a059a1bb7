"""An assistant reply read out of generated text: its reasoning, then its content and tool
calls (tools are parsed in the content only), whole or delta by delta."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cenote.assistant.reasoning import ReasoningFormat, ReasoningStream
from cenote.assistant.tool_parsers import ToolCallFormat, ToolCallStream, new_tool_call_id
from cenote.outputs import ToolCall


@dataclass
class AssistantDelta:
    """What one text delta adds to the reply (empty strings: nothing new)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class AssistantMessage:
    """A whole reply."""

    content: str | None  # None: empty
    reasoning_content: str | None  # None: no thinking (or no reasoning parser)
    tool_calls: list[ToolCall]


class AssistantStream:
    """Generated text in, reply deltas out. Without formats the text is all content."""

    def __init__(
        self,
        reasoning: ReasoningFormat | None,
        tools: ToolCallFormat | None,
        new_id: Callable[[], str] = new_tool_call_id,
        max_calls: int | None = None,
    ) -> None:
        """``max_calls``: the calls kept (1 for ``parallel_tool_calls`` false, as vLLM and
        OpenAI answer); later ones are dropped, neither calls nor content."""
        self._reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self._tools = ToolCallStream(tools, new_id, max_calls) if tools is not None else None

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, text: str) -> AssistantDelta:
        return self._split(text, final=False)

    def finish(self) -> AssistantDelta:
        """The rest, once the output has ended."""
        return self._split("", final=True)

    def _split(self, text: str, final: bool) -> AssistantDelta:
        # 1) thinking first
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish() if final else self._reasoning.feed(text)
        # 2) tool calls in the content
        if self._tools is None:
            return AssistantDelta(reasoning, content)
        events = self._tools.feed(content) if content else []
        if final:
            events += self._tools.finish()
        return AssistantDelta(
            reasoning,
            "".join(e for e in events if isinstance(e, str)),
            [e for e in events if isinstance(e, ToolCall)],
        )


def parse_assistant(
    text: str,
    reasoning: ReasoningFormat | None,
    tools: ToolCallFormat | None,
    new_id: Callable[[], str] = new_tool_call_id,
    max_calls: int | None = None,
) -> AssistantMessage:
    """The reply a whole generated text makes (what its deltas add up to)."""
    stream = AssistantStream(reasoning, tools, new_id, max_calls)
    first, last = stream.feed(text), stream.finish()
    return AssistantMessage(
        content=(first.content + last.content) or None,
        reasoning_content=(first.reasoning + last.reasoning) or None,
        tool_calls=first.tool_calls + last.tool_calls,
    )
