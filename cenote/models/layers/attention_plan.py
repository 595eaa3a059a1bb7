"""Index tensors of one step's paged attention, built once per step (and sliding window) by
the first layer that needs them, shared by the others through the step's ``AttentionMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cenote.forward_context import AttentionMetadata


def paged_plan(metadata: AttentionMetadata, window: int | None = None) -> PagedPlan:
    """The plan of the layers that see keys fewer than ``window`` positions back (None: all)."""
    key = ("paged", window)
    plan = metadata.plans.get(key)
    if plan is None:
        plan = metadata.plans[key] = PagedPlan.build(metadata, window)
    return plan


@dataclass
class PrefillRow:
    """A request computing more than one token this step (a prompt or a chunk of one)."""

    rows: slice  # its rows in the flat token stream
    blocks: torch.Tensor  # [num_blocks] int64 its KV blocks, from the first one any row can see
    seq_len: int  # keys attended: context length after this step, less the positions before
    # the first gathered block (sliding windows skip blocks no query of the chunk sees)
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True = attend; None = plain causal
    cached_context: bool  # context precedes the chunk: keys are read from the cache


@dataclass
class PagedPlan:
    """Decode rows (one new token each) attend together; prefill rows one by one.

    With a sliding ``window``, each request's blocks start at the first block holding a key its
    queries can see (earlier ones may already be freed), and the masks cut keys ``window`` or
    more positions back."""

    decode_rows: torch.Tensor | None  # [num_decode] row of each decode request in the stream
    all_decode: bool  # every request decodes, in order: rows are the whole stream
    decode_tables: torch.Tensor | None  # [num_decode, max_blocks] int64, padded with block 0s
    decode_padding: torch.Tensor | None  # [num_decode, max_blocks * block_size] bool, True = pad
    prefills: list[PrefillRow]

    @classmethod
    def build(cls, md: AttentionMetadata, window: int | None = None) -> PagedPlan:
        lens = md.query_lens
        size = md.block_size
        decode = [i for i, n in enumerate(lens) if n == 1]
        prefills = []
        for i, n in enumerate(lens):
            if n == 1:
                continue
            seq_len = md.seq_lens[i]
            first = _first_visible_block(seq_len - n, window, size)
            mask = None
            if n != seq_len or (window is not None and n > window):
                # causal, bottom-right aligned, within the window
                queries = torch.arange(seq_len - n, seq_len).unsqueeze(1)
                keys = torch.arange(first * size, seq_len).unsqueeze(0)
                mask = keys <= queries
                if window is not None:
                    mask &= keys > queries - window
            blocks = torch.tensor(md.block_tables[i][first:], dtype=torch.long)
            rows = slice(md.query_start_loc[i], md.query_start_loc[i + 1])
            prefills.append(PrefillRow(rows, blocks, seq_len - first * size, mask, n != seq_len))
        if not decode:
            return cls(None, False, None, None, prefills)
        seq_lens = [md.seq_lens[i] for i in decode]
        if window is None:
            tables = [md.block_tables[i] for i in decode]
        else:
            firsts = [_first_visible_block(n - 1, window, size) for n in seq_lens]
            tables = [md.block_tables[i][f:] for i, f in zip(decode, firsts, strict=True)]
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.long)
        positions = torch.arange(width * size).unsqueeze(0)  # [1, width * block_size]
        if window is not None:  # [num_decode, width * block_size]
            positions = positions + torch.tensor(firsts).unsqueeze(1) * size
        ends = torch.tensor(seq_lens).unsqueeze(1)
        padding = positions >= ends
        if window is not None:
            padding |= positions <= ends - 1 - window
        rows = torch.tensor([md.query_start_loc[i] for i in decode], dtype=torch.long)
        return cls(rows, len(decode) == len(lens), padded, padding, prefills)


def _first_visible_block(position: int, window: int | None, block_size: int) -> int:
    """The first block holding a key that a query at ``position`` (or later) can see."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size
