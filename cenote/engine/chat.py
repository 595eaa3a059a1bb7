"""Render chat messages with the model's Jinja chat template, in a sandbox."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cenote.errors import InvalidInputError

ChatMessage = dict[str, Any]  # {"role": ..., "content": ...}


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str):
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
    **variables: Any,
) -> str:
    """The prompt text for ``messages``. Templates run sandboxed: no attribute access to Python
    internals, no file or network access."""
    if template is None:
        raise InvalidInputError(
            "the model has no chat template; pass chat_template=... or use generate() with text"
        )
    _check_messages(messages)
    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except TemplateError as e:
        raise InvalidInputError(f"chat template failed: {e}") from e


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidInputError(f"message {i} must be a dict with a 'role' and a 'content'")


def render_template(template: str, **variables: Any) -> str:
    """Render a plain text template (e.g. a reranker's query/document prompt) in the same
    sandbox as chat templates."""
    try:
        return _compile(template).render(**variables)
    except TemplateError as e:
        raise InvalidInputError(f"template failed: {e}") from e


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
