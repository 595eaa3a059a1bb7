"""The prompts a request may carry (vLLM's shapes, plus chat and cross-encoder pairs). The input
processor turns each into token ids; nothing else tokenizes."""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

# how a text is encoded where a model tells queries from documents (ColBERT's markers)
TextRole = Literal["query", "document"]


class TextPrompt(TypedDict):
    """Text, tokenized by the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """Token ids, used as given (truncation still applies)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str | None]  # the text they came from, echoed in outputs


class ChatPrompt(TypedDict):
    """A conversation, rendered by the chat template (the model's, or ``chat_template``)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: NotRequired[bool]  # open an assistant turn (default: True)
    continue_final_message: NotRequired[bool]  # leave the last (assistant) message open
    chat_template: NotRequired[str | None]  # a Jinja template instead of the model's
    chat_template_kwargs: NotRequired[dict[str, Any] | None]  # extra template variables
    tools: NotRequired[list[dict[str, Any]] | None]  # tool definitions the template renders


class PairPrompt(TypedDict):
    """A cross-encoder pair: ``[CLS] text [SEP] text_pair [SEP]`` with segment ids; only the
    pair's second text is cut to fit."""

    text: str
    text_pair: str


class ImagePrompt(TypedDict):
    """An image for a model with a vision tower (CLIP, SigLIP): a ``PIL.Image.Image``, a local
    path (offline) or a URL string (``data:``; ``file://`` and http(s) as the server allows)."""

    image: Any


PromptType = str | TextPrompt | TokensPrompt | ChatPrompt | PairPrompt | ImagePrompt
