"""Attention metadata reaches the model through a scoped context, never a global argument list."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property

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

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        loc = self.query_start_loc
        return [loc[i + 1] - loc[i] for i in range(len(loc) - 1)]

    @cached_property
    def paged(self) -> PagedPlan:
        """Index tensors of the paged path, built once per step and shared by every layer."""
        return PagedPlan.build(self)


@dataclass
class PrefillRow:
    """A request computing more than one token this step (a prompt or a chunk of one)."""

    rows: slice  # its rows in the flat token stream
    blocks: torch.Tensor  # [num_blocks] int64 its KV blocks
    seq_len: int  # context length after this step
    mask: torch.Tensor | None  # [query_len, seq_len] bool when cached context precedes the chunk


@dataclass
class PagedPlan:
    """Decode rows (one new token each) attend together; prefill rows one by one."""

    decode_rows: torch.Tensor | None  # [num_decode] row of each decode request in the stream
    all_decode: bool  # every request decodes, in order: rows are the whole stream
    decode_tables: torch.Tensor | None  # [num_decode, max_blocks] int64, padded with block 0s
    decode_padding: torch.Tensor | None  # [num_decode, max_blocks * block_size] bool, True = pad
    prefills: list[PrefillRow]

    @classmethod
    def build(cls, md: AttentionMetadata) -> PagedPlan:
        lens = md.query_lens
        decode = [i for i, n in enumerate(lens) if n == 1]
        prefills = []
        for i, n in enumerate(lens):
            if n == 1:
                continue
            seq_len = md.seq_lens[i]
            mask = None
            if n != seq_len:  # a chunk after cached context: causal, bottom-right aligned
                positions = torch.arange(seq_len - n, seq_len).unsqueeze(1)
                mask = torch.arange(seq_len).unsqueeze(0) <= positions
            blocks = torch.tensor(md.block_tables[i], dtype=torch.long)
            prefills.append(
                PrefillRow(
                    slice(md.query_start_loc[i], md.query_start_loc[i + 1]), blocks, seq_len, mask
                )
            )
        if not decode:
            return cls(None, False, None, None, prefills)
        tables = [md.block_tables[i] for i in decode]
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.long)
        seq_lens = torch.tensor([md.seq_lens[i] for i in decode])
        padding = torch.arange(width * md.block_size).unsqueeze(0) >= seq_lens.unsqueeze(1)
        rows = torch.tensor([md.query_start_loc[i] for i in decode], dtype=torch.long)
        return cls(rows, len(decode) == len(lens), padded, padding, prefills)


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
