"""Embed a batch of passages with an offline ``LLM``: the one step the single-process corpus job
and the Ray Data workers (``cenote.ray.Embedder``) share, so both give the same numbers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from cenote.errors import InvalidInputError
from cenote.pooling_params import PoolingParams

if TYPE_CHECKING:
    from cenote.entrypoints.llm import LLM


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
    try:
        outputs = llm.embed(
            list(texts), params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=False
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
            row = int(rows[i]) if rows is not None else i
            message = str(e).replace("prompt 0 ", "the passage ", 1)
            if "truncate_prompt_tokens" in message:
                message += " (cenote embed: --truncate)"
            return RowError(row, message)
    return error
