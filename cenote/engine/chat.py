"""Render chat messages with the model's Jinja chat template, in a sandbox."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cenote.errors import InvalidInputError

ChatMessage = dict[str, Any]  # {"role": ..., "content": ...}
ROLES = ("system", "user", "assistant", "tool", "developer")  # OpenAI's roles; others refused


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str) -> Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, indent=indent, ensure_ascii=False
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str | None,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **variables: Any,
) -> str:
    """The prompt text for ``messages``. Templates run sandboxed: no attribute access to Python
    internals, no file or network access. Roles are OpenAI's; content is a string or a list of
    text parts (joined with newlines). ``continue_final_message`` ends the prompt right after the
    last message's content, so the model continues it."""
    if template is None:
        raise InvalidInputError(
            "the model has no chat template; pass chat_template=... or use generate() with text"
        )
    if continue_final_message and add_generation_prompt:
        raise InvalidInputError(
            "continue_final_message and add_generation_prompt cannot both be true: "
            "set add_generation_prompt to false to continue the last message"
        )
    messages = normalize_messages(messages)
    try:
        text = _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except TemplateError as e:
        raise InvalidInputError(f"chat template failed: {e}") from e
    except Exception as e:  # a template error on odd input (a None, a missing key) is the input's
        raise InvalidInputError(
            f"chat template failed on these messages: {type(e).__name__}: {e}"
        ) from e
    return _open_final_message(text, messages[-1]) if continue_final_message else text


def normalize_messages(messages: Any) -> list[ChatMessage]:
    """Checked copies of ``messages`` with text content: roles in ``ROLES``; content a string,
    OpenAI content parts (``[{"type": "text", "text": ...}]``, joined by newlines), or null /
    missing (an assistant turn with tool calls), rendered as ``""``."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("messages must be a non-empty list of {'role', 'content'} dicts")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidInputError(f"message {i} must be a dict with a 'role' and a 'content'")
        role = message["role"]
        if role not in ROLES:
            raise InvalidInputError(
                f"message {i} has role {role!r:.40}; the roles are {', '.join(ROLES)}"
            )
        copy = {**message, "content": _text_content(message.get("content"), i)}
        if message.get("tool_calls") is not None:
            copy["tool_calls"] = _template_tool_calls(message["tool_calls"], i)
        normalized.append(copy)
    return normalized


def _template_tool_calls(tool_calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls as HF templates read them: ``arguments`` as a dict
    (OpenAI sends a JSON string; templates write ``arguments | tojson``)."""
    if not isinstance(tool_calls, list):
        raise InvalidInputError(f"message {index}: tool_calls must be a list")
    calls = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidInputError(
                f"message {index}: tool_calls[{j}] must be {{'type': 'function', 'function': "
                "{'name': ..., 'arguments': ...}}"
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise InvalidInputError(
                    f"message {index}: tool_calls[{j}].function.arguments is not valid JSON: {e}"
                ) from e
        calls.append({**call, "function": {**function, "arguments": arguments}})
    return calls


def _text_content(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidInputError(
            f"message {index}: content must be a string or a list of content parts, "
            f"got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
            raise InvalidInputError(
                f"message {index}: content part {j} has type {kind!r:.40}; this model reads "
                "text parts only ({'type': 'text', 'text': ...})"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _open_final_message(text: str, final: ChatMessage) -> str:
    """``text`` cut right after the final message's content (the end-of-turn tokens go)."""
    content = (final.get("content") or "").strip()
    position = text.rfind(content) if content else -1
    if position < 0:
        raise InvalidInputError(
            "continue_final_message needs a last message with non-empty content that the chat "
            "template writes out verbatim"
        )
    return text[: position + len(content)]


def render_template(template: str, **variables: Any) -> str:
    """Render a plain text template (e.g. a reranker's query/document prompt) in the same
    sandbox as chat templates."""
    try:
        text: str = _compile(template).render(**variables)
        return text
    except Exception as e:  # TemplateError, or a TypeError on odd input
        raise InvalidInputError(f"template failed: {type(e).__name__}: {e}") from e


def special_token_variables(tokenizer: Any, hf_config: dict[str, Any]) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` strings that chat templates may reference."""
    variables = {}
    for name in ("bos", "eos"):
        token_id = hf_config.get(f"{name}_token_id")
        if isinstance(token_id, int):
            token = tokenizer.id_to_token(token_id)
            if token is not None:
                variables[f"{name}_token"] = token
    return variables
