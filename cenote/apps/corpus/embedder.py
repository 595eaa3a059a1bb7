"""Embed a batch of passages with an offline ``LLM``: the one step the single-process corpus job
and the Ray Data workers (``cenote.ray.Embedder``) share, so both give the same numbers.

A passage is bounded by characters before it is tokenized (the tokenizer's memory grows with
them): without truncation one longer than ``MAX_PASSAGE_CHARS`` is refused; with it, a long
passage is cut at a space to a prefix that still holds more tokens than the truncation keeps,
so its tokens are those of the whole passage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from cenote.engine.input_processor import DEFAULT_MAX_INPUT_CHARS, InputProcessor
from cenote.errors import InvalidInputError
from cenote.pooling_params import PoolingParams

if TYPE_CHECKING:
    from cenote.llm import LLM

MAX_PASSAGE_CHARS = DEFAULT_MAX_INPUT_CHARS  # the server's default bound on one text
CHARS_PER_TOKEN = 32  # a first cut's characters per kept token: real tokens are rarely over 20
_CUT_WINDOW = 1024  # how far back from a cut a space is looked for


class RowError(InvalidInputError):
    """A passage the model cannot embed as given; ``row`` is its 0-based row in the input."""

    def __init__(self, row: int, message: str) -> None:
        super().__init__(row, message)
        self.row = row
        self.message = message

    def __str__(self) -> str:
        return f"row {self.row}: {self.message}"


def embed_passages(
    llm: LLM,
    texts: Sequence[str],
    rows: Sequence[int] | None = None,
    truncate_prompt_tokens: int | None = None,
    dimensions: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings ``[num_texts, dim]`` float32 and token counts ``[num_texts]`` int32, in input
    order. A passage the engine refuses (too long without truncation) raises ``RowError`` with
    its row (``rows[i]``, else its index here)."""

    params = PoolingParams(dimensions=dimensions) if dimensions is not None else None
    fit = _Fit(llm.input_processor, truncate_prompt_tokens)
    texts = [fit(text, _row(rows, i)) for i, text in enumerate(texts)]
    try:
        outputs = llm.embed(
            texts, params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=False
        )
    except InvalidInputError as e:
        raise _locate(llm, texts, rows, truncate_prompt_tokens, e) from e
    if not outputs:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int32)
    embeddings = np.stack([out.outputs.data.float().numpy() for out in outputs])
    num_tokens = np.fromiter((len(out.prompt_token_ids) for out in outputs), np.int32)
    return embeddings.astype(np.float32, copy=False), num_tokens


def _locate(
    llm: LLM,
    texts: Sequence[str],
    rows: Sequence[int] | None,
    truncate_prompt_tokens: int | None,
    error: InvalidInputError,
) -> Exception:
    """The first passage that fails on its own, as a ``RowError``; ``error`` if none does."""
    for i, text in enumerate(texts):
        try:
            params = PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
            llm.input_processor.process("locate", text, params)
        except InvalidInputError as e:
            row = _row(rows, i)
            message = str(e).replace("prompt 0 ", "the passage ", 1)
            if "truncate_prompt_tokens" in message:
                message += " (cenote embed: --truncate)"
            return RowError(row, message)
    return error


class _Fit:
    """A passage as the tokenizer may see it (see the module's docstring)."""

    def __init__(self, processor: InputProcessor, truncate_prompt_tokens: int | None) -> None:
        self.processor = processor
        self.max_tokens = processor.validator.truncation_length(truncate_prompt_tokens)
        self.params = PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)

    def __call__(self, text: str, row: int) -> str:
        if self.max_tokens is None:
            if len(text) > MAX_PASSAGE_CHARS:
                raise RowError(
                    row,
                    f"the passage has {len(text)} characters, more than the limit of "
                    f"{MAX_PASSAGE_CHARS} (max_input_chars); pass --truncate to embed its start",
                )
            return text
        limit = self.max_tokens * CHARS_PER_TOKEN
        while len(text) > limit:
            cut = _cut(text, limit)
            if self.processor.process("fit", cut, self.params).truncated:
                return cut
            if limit >= MAX_PASSAGE_CHARS:
                raise RowError(
                    row,
                    f"the passage has {len(text)} characters and its first {MAX_PASSAGE_CHARS} "
                    f"(max_input_chars) hold no more than the {self.max_tokens} tokens "
                    "truncation keeps; it is refused rather than tokenized whole",
                )
            limit = min(2 * limit, MAX_PASSAGE_CHARS)
        return text


def _cut(text: str, limit: int) -> str:
    """The first ``limit`` characters of ``text``, ended before a space when there is one near
    the end, so no word is split and the prefix tokenizes as it does in the whole text."""
    start = max(limit - _CUT_WINDOW, 0)
    space = max(text.rfind(c, start, limit + 1) for c in " \n\t\r")
    if space <= 0:
        return text[:limit]
    return text[:space].rstrip() or text[:limit]


def _row(rows: Sequence[int] | None, index: int) -> int:
    return int(rows[index]) if rows is not None else index
