"""Task names, vLLM-compatible."""

from __future__ import annotations

from typing import Literal, get_args

# embed_sparse: one (token id, weight) vector over the vocabulary per prompt (SPLADE)
PoolingTask = Literal["embed", "token_embed", "classify", "token_classify", "embed_sparse"]
# one task, or several answered from one trunk pass (a multi-task pooling request)
PoolingTaskSelection = PoolingTask | tuple[PoolingTask, ...]
GenerationTask = Literal["generate"]
SupportedTask = Literal[
    "generate", "embed", "token_embed", "classify", "token_classify", "embed_sparse"
]

POOLING_TASKS: tuple[PoolingTask, ...] = get_args(PoolingTask)
