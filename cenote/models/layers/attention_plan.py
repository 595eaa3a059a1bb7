"""Index tensors of one step's paged attention, built once per step (and sliding window) by
the first layer that needs them, shared by the others through the step's ``AttentionMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from cenote.forward_context import AttentionMetadata
from cenote.platforms import to_device


@dataclass
class PrefillRow:
    """A chunk of a prompt that follows context already in the cache."""

    rows: slice  # its rows in the flat token stream
    blocks: torch.Tensor  # [num_blocks] int64 its KV blocks, from the first one any row can see
    seq_len: int  # keys attended: context length after this step, less the positions before
    # the first gathered block (sliding windows skip blocks no query of the chunk sees)
    mask: torch.Tensor  # [query_len, seq_len] bool, True = attend: causal, bottom-right aligned


@dataclass
class PagedPlan:
    """Decode rows (a request's one new token, or each token of a short chunk after cached
    context) attend together over their blocks; prompts computed whole this step attend to
    their own new rows (as an encoder batch, causal); longer chunks after cached context one by
    one over their blocks.

    With a sliding ``window``, each request's block table starts at the first block holding a
    key its queries can see (earlier ones may already be freed), and the masks cut keys
    ``window`` or more positions back."""

    block_size: int  # tokens per KV block
    decode_rows: torch.Tensor | None  # [num_decode] row of each decode row in the stream
    all_decode: bool  # every row is a decode row, in order: they are the whole stream
    decode_tables: torch.Tensor | None  # [num_decode, max_blocks] int64, padded with block 0s
    decode_starts: torch.Tensor | None  # [num_decode] int64 first key, in table positions
    decode_ends: torch.Tensor | None  # [num_decode] int64 one past the last key (the new one)
    fresh_starts: list[int]  # first row of each prompt computed whole this step
    fresh_lengths: list[int]  # its length
    prefills: list[PrefillRow]  # chunks that follow cached context

    @cached_property
    def decode_padding(self) -> torch.Tensor:
        """[num_decode, max_blocks * block_size] bool, True = not a key of the row."""
        assert self.decode_tables is not None
        assert self.decode_starts is not None and self.decode_ends is not None
        width = self.decode_tables.shape[1] * self.block_size
        positions = torch.arange(width, device=self.decode_tables.device).unsqueeze(0)
        starts, ends = self.decode_starts.unsqueeze(1), self.decode_ends.unsqueeze(1)
        return (positions < starts) | (positions >= ends)


def paged_plan(metadata: AttentionMetadata, window: int | None = None) -> PagedPlan:
    """The plan of the layers that see keys fewer than ``window`` positions back (None: all)."""
    key = _plan_key(window)
    plan = metadata.plans.get(key)
    if plan is None:
        plan = metadata.plans[key] = _build_paged_plan(metadata, window)
    return plan


# A chunk of at most this many new tokens after cached context (speculative decoding's drafts,
# short prompt chunks) attends as that many decode rows, each over the request's blocks in
# place up to its own position, instead of gathering the blocks once for an SDPA call: the
# gather copies the whole context per layer, which a few rows do not repay.
_MAX_DECODE_CHUNK = 16


def _build_paged_plan(md: AttentionMetadata, window: int | None) -> PagedPlan:
    lens = md.query_lens
    size = md.block_size
    assert md.block_tables is not None
    decode: list[tuple[int, int, int]] = []  # (request, its row in the stream, keys it sees)
    fresh, prefills = [], []
    for i, n in enumerate(lens):
        seq_len = md.seq_lens[i]
        if n == 1 or (n != seq_len and n <= _MAX_DECODE_CHUNK):
            start = md.query_start_loc[i]
            decode.extend((i, start + j, seq_len - n + j + 1) for j in range(n))
            continue
        if n == seq_len:
            fresh.append(i)
            continue
        first = first_visible_block(seq_len - n, window, size)
        queries = torch.arange(seq_len - n, seq_len).unsqueeze(1)
        keys = torch.arange(first * size, seq_len).unsqueeze(0)
        mask = keys <= queries
        if window is not None:
            mask &= keys > queries - window
        blocks = torch.tensor(md.block_tables[i][first:], dtype=torch.long)
        rows = slice(md.query_start_loc[i], md.query_start_loc[i + 1])
        blocks, mask = blocks.to(md.device), mask.to(md.device)  # no-ops on the CPU
        prefills.append(PrefillRow(rows, blocks, seq_len - first * size, mask))
    fresh_starts = [md.query_start_loc[i] for i in fresh]
    fresh_lengths = [lens[i] for i in fresh]
    if not decode:
        return PagedPlan(size, None, False, None, None, None, fresh_starts, fresh_lengths, prefills)
    firsts = [first_visible_block(n - 1, window, size) for _, _, n in decode]
    tables = [md.block_tables[i][f:] for (i, _, _), f in zip(decode, firsts, strict=True)]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.long)
    ends = torch.tensor([n - f * size for (_, _, n), f in zip(decode, firsts, strict=True)])
    starts = torch.zeros_like(ends) if window is None else (ends - window).clamp_(min=0)
    decode_rows = torch.tensor([row for _, row, _ in decode], dtype=torch.long)
    all_decode = len(decode) == sum(lens)
    # one host -> device copy for the four, shared by every layer; none on the CPU
    padded, starts, ends, decode_rows = to_device([padded, starts, ends, decode_rows], md.device)
    return PagedPlan(
        size, decode_rows, all_decode, padded, starts, ends, fresh_starts, fresh_lengths, prefills
    )


def preset_decode_plan(
    metadata: AttentionMetadata,
    window: int | None,
    *,
    tables: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
) -> None:
    """Give a step whose rows all decode, in order, its plan for ``window`` ready-made (CUDA
    graphs: the tensors are views of static buffers the host filled before the replay).
    ``tables`` [rows, max_blocks] int64 (rows may be strided, entries contiguous), ``starts`` /
    ``ends`` [rows] int64 as in ``PagedPlan``."""
    rows = torch.arange(tables.shape[0], device=tables.device)
    plan = PagedPlan(metadata.block_size, rows, True, tables, starts, ends, [], [], [])
    metadata.plans[_plan_key(window)] = plan


def _plan_key(window: int | None) -> tuple[str, int | None]:
    return ("paged", window)


def first_visible_block(position: int, window: int | None, block_size: int) -> int:
    """The first block holding a key that a query at ``position`` (or later) can see."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size
