"""Attention metadata reaches the model through a scoped context, never a global argument list."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """How the flat token stream of one step splits into requests."""

    query_start_loc: list[int]  # [num_requests + 1] cumulative new-token counts
    seq_lens: list[int]  # [num_requests] context length after this step (computed + new)
    causal: bool  # decoder (causal mask, KV cache) or encoder (bidirectional, no cache)
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64 KV slot of each new token
    block_tables: list[list[int]] | None = None  # [num_requests] KV block ids of each request
    block_size: int = 16  # tokens per KV block
    # per layer, shaped by models.layers.attention.kv_cache_shape
    kv_caches: list[torch.Tensor] | None = None
    device: torch.device = torch.device("cpu")  # the model's: where the step's index tensors go
    # attention's index tensors of this step (models.layers.attention_plan), built by the
    # first layer that needs them and shared by the others
    plans: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        return [end - start for start, end in pairwise(self.query_start_loc)]


_CONTEXT: ContextVar[AttentionMetadata | None] = ContextVar("cenote_forward_context", default=None)


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Make ``metadata`` visible to attention layers for the duration of one forward pass."""
    token = _CONTEXT.set(metadata)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def get_attention_metadata() -> AttentionMetadata:
    metadata = _CONTEXT.get()
    if metadata is None:
        raise RuntimeError("attention layers run only inside `with forward_context(...)`")
    return metadata
