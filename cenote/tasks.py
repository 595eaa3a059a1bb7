"""Task names, vLLM-compatible."""

from __future__ import annotations

from typing import Literal, get_args

PoolingTask = Literal["embed", "token_embed", "classify", "token_classify"]
GenerationTask = Literal["generate"]
SupportedTask = Literal["generate", "embed", "token_embed", "classify", "token_classify"]

POOLING_TASKS: tuple[str, ...] = get_args(PoolingTask)
