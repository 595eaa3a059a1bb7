"""The tools of a chat request, checked, and what they ask of it: the definitions the chat
template renders, the format its output is parsed in, the grammar that forces a call."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from llguidance import LLMatcher
from tokenizers import Tokenizer

from cenote.assistant.grammar import tool_call_grammar
from cenote.assistant.tool_parsers import JSON_LIST, ToolCallFormat
from cenote.errors import InvalidInputError
from cenote.sampling_params import SamplingParams
from cenote.structured.params import StructuredOutputsParams, checked_grammar

ToolChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class FunctionTool:
    """An OpenAI function tool."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    def as_template_tool(self) -> dict[str, Any]:
        """The definition as chat templates read it (HF ``apply_chat_template(tools=...)``)."""
        function = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    tools: list[FunctionTool]
    tool_choice: ToolChoiceMode
    function_name: str | None  # tool_choice "named": the function to call
    format: ToolCallFormat | None  # the output's calls are parsed in it; None: not parsed
    grammar: str | None  # required / named: the Lark grammar the output must match
    parallel: bool = True  # parallel_tool_calls: more than one call per reply

    @property
    def max_calls(self) -> int | None:
        """The calls a reply keeps: one without parallel calls, else all."""
        return None if self.parallel else 1

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.as_template_tool() for tool in self.tools]

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with what the tools need: the forcing grammar, and special tokens kept
        in the text when the format's markers are special tokens."""
        changes: dict[str, Any] = {}
        if self.grammar is not None:
            if params.structured_outputs is not None:
                raise InvalidInputError(
                    f"tool_choice {self.tool_choice!r} forces a tool call with a grammar; it "
                    "cannot be combined with structured outputs or response_format",
                    param="tool_choice",
                )
            changes["structured_outputs"] = StructuredOutputsParams(grammar=self.grammar)
        if self.format is not None and self.format.keeps_special_tokens:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params


def _tool(raw: Any, index: int) -> FunctionTool:
    where = f"tools[{index}]"
    if not isinstance(raw, Mapping) or raw.get("type", "function") != "function":
        raise InvalidInputError(
            f"{where} must be {{'type': 'function', 'function': {{...}}}}; function tools are "
            "the only kind",
            param="tools",
        )
    function = raw.get("function")
    if not isinstance(function, Mapping):
        raise InvalidInputError(f"{where}.function must be an object", param="tools")
    name, parameters = function.get("name"), function.get("parameters")
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"{where}.function.name must be a non-empty string", "tools")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise InvalidInputError(
            f"{where}.function.parameters must be a JSON schema object, got "
            f"{type(parameters).__name__}",
            param="tools",
        )
    description, strict = function.get("description"), function.get("strict")
    return FunctionTool(
        name, description if isinstance(description, str) else None,
        dict(parameters) if parameters is not None else None,
        strict if isinstance(strict, bool) else None,
    )  # fmt: skip


def _choice(tool_choice: Any) -> tuple[ToolChoiceMode, str | None]:
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise InvalidInputError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    return "named", name


def plan_tools(
    tools: Sequence[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    template: str | None,
    format: ToolCallFormat | None,
    tokenizer: Tokenizer | None = None,
) -> ToolPlan | None:
    """The checked plan of a request's ``tools`` and ``tool_choice`` (None: no tools, nothing
    to do). ``template``: the chat template (it must read ``tools``); ``format``: how this model
    writes calls (None: unknown; forced calls then use cenote's JSON list)."""
    # 1) the definitions: function tools, each name once, parameters an object
    checked = [_tool(raw, i) for i, raw in enumerate(tools or [])]
    names = [tool.name for tool in checked]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidInputError(
            f"tools name the function {duplicates[0]!r} {names.count(duplicates[0])} times; "
            "each function name must be unique",
            param="tools",
        )
    # 2) the choice: default auto with tools (OpenAI), and only what the tools allow
    mode, name = _choice(tool_choice if tool_choice is not None else "auto")
    if not checked:
        if mode in ("required", "named"):
            raise InvalidInputError(
                f"tool_choice {tool_choice!r:.80} needs tools, and the request has none",
                param="tool_choice",
            )
        return None
    if name is not None and name not in names:
        raise InvalidInputError(
            f"tool_choice names the function {name!r:.80}, which is not in tools (the tools "
            f"are {', '.join(names)})",
            param="tool_choice",
        )
    # 3) the template must render them, or the model never sees them
    if template is not None and "tools" not in template:
        raise InvalidInputError(
            "this model's chat template never reads 'tools', so the model would not see them; "
            "pass a chat template that renders tools (--chat-template)",
            param="tools",
        )
    # 4) required / named: a grammar in the model's format forces the call
    grammar = None
    if mode in ("required", "named"):
        functions = [(t.name, t.parameters) for t in checked if name is None or t.name == name]
        format = format or JSON_LIST
        grammar = tool_call_grammar(
            format, functions, parallel=parallel_tool_calls is not False and name is None,
            special_ids=special_marker_ids(tokenizer, format) if tokenizer else None,
        )  # fmt: skip
        error = checked_grammar(LLMatcher.grammar_from_lark(grammar))
        if error:  # a parameters schema llguidance cannot compile
            raise InvalidInputError(
                f"tool_choice {mode!r} forces a call, but the tools' parameters schemas do not "
                f"compile: {error}",
                param="tools",
            )
    parallel = parallel_tool_calls is not False
    return ToolPlan(checked, mode, name, None if mode == "none" else format, grammar, parallel)


def special_marker_ids(tokenizer: Tokenizer, format: ToolCallFormat) -> dict[str, int]:
    """The format's markers that are special tokens of ``tokenizer``, with their ids."""
    markers = {*format.starts, *(format.end,)}
    added = tokenizer.get_added_tokens_decoder()
    return {t.content: i for i, t in added.items() if t.special and t.content in markers}
