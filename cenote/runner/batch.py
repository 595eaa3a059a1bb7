"""The flat batch of one step: token ids, positions, cumulative lengths, KV slots.

Encoder steps (no KV cache) are padded at the end of the flat batch to one of a bounded set of
row counts. oneDNN builds (and caches) a matmul primitive per distinct row count: a new count
costs milliseconds per weight shape (docs/performance.md), so an embedding server whose every
step has a new token count spent most of its time building primitives. The padding rows form
one dummy sequence (positions 0, 1, ...) that no request, attention call or pooler reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cenote.forward_context import AttentionMetadata
from cenote.images.batch import ImageBatch
from cenote.platforms import to_device
from cenote.scheduler.output import ScheduledRequest


@dataclass
class InputBatch:
    """Tensors fed to the trunk, plus where each request's rows lie."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each token in its request
    token_type_ids: torch.Tensor | None  # [num_tokens] int64, when any request has segments
    attention: AttentionMetadata  # cumulative lengths, KV slots and block tables
    row_ends: list[int]  # [num_requests] index one past each request's last row
    num_tokens: int  # rows that belong to requests; the rows after them are padding
    images: ImageBatch | None = None  # the image requests' pixels (their rows: placeholders)


def build_input_batch(
    scheduled: list[ScheduledRequest],
    block_size: int,
    kv_caches: list[torch.Tensor] | None,
    max_position: int | None = None,
    device: torch.device | None = None,
) -> InputBatch:
    """Concatenate the new tokens of every scheduled request, in batch order. Without a KV cache
    the batch is padded to ``padded_rows(num_tokens, max_position)`` rows (``max_position``: the
    model's position limit, which the padding's positions stay below; None: no padding). The
    tensors are built on the host and reach ``device`` (None: the host) in one copy."""
    device = device or torch.device("cpu")
    input_ids: list[int] = []
    positions: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    has_segments = any(s.token_type_ids is not None for s in scheduled)
    token_types: list[int] = []
    for s in scheduled:
        input_ids.extend(s.token_ids)
        positions.extend(range(s.start_position, s.start_position + s.num_tokens))
        query_start_loc.append(query_start_loc[-1] + s.num_tokens)
        seq_lens.append(s.start_position + s.num_tokens)
        if has_segments:
            token_types.extend(s.token_type_ids or [0] * s.num_tokens)
    num_tokens = len(input_ids)
    if kv_caches is None and max_position is not None:
        padding = padded_rows(num_tokens, max_position) - num_tokens
        input_ids.extend([0] * padding)
        positions.extend(range(padding))
        token_types.extend([0] * padding if has_segments else [])
    positions_tensor = torch.tensor(positions, dtype=torch.long)
    # one copy to the device for all of them (on the host: the tensors themselves)
    parts = [torch.tensor(input_ids, dtype=torch.long), positions_tensor]
    if has_segments:
        parts.append(torch.tensor(token_types, dtype=torch.long))
    block_tables = None
    if kv_caches is not None:
        block_tables = [s.block_ids for s in scheduled]
        parts.append(_slot_mapping(scheduled, positions_tensor, block_size))
    moved = to_device(parts, device)
    slot_mapping = moved.pop() if kv_caches is not None else None
    token_type_ids = moved.pop() if has_segments else None
    attention = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        causal=kv_caches is not None,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        block_size=block_size,
        kv_caches=kv_caches,
        device=device,
    )
    return InputBatch(
        images=_image_batch(scheduled, device),
        input_ids=moved[0],
        positions=moved[1],
        token_type_ids=token_type_ids,
        attention=attention,
        row_ends=query_start_loc[1:],
        num_tokens=num_tokens,
    )


def _image_batch(scheduled: list[ScheduledRequest], device: torch.device) -> ImageBatch | None:
    """The pixels of the step's image requests, stacked (None: no image in the step)."""
    indices = [i for i, s in enumerate(scheduled) if s.pixel_values is not None]
    if not indices:
        return None
    pixels = [scheduled[i].pixel_values for i in indices]
    stacked = torch.stack([p for p in pixels if p is not None]).to(device)
    return ImageBatch(pixel_values=stacked, request_indices=indices)


def padded_rows(num_tokens: int, max_position: int) -> int:
    """``num_tokens`` rounded up to a multiple of ``clamp(next_pow2(num_tokens) / 16, 16, 128)``
    (at most ``max_position``): about 90 distinct counts up to 8,192 tokens, each padding a step by
    at most 1/8 of its rows (3% on average above 1,024 rows)."""
    if num_tokens <= 0:
        return num_tokens
    granule = min(max(16, (1 << (num_tokens - 1).bit_length()) // 16), 128)
    granule = min(granule, 1 << (max_position.bit_length() - 1))  # padding positions < limit
    return -(-num_tokens // granule) * granule


def _slot_mapping(
    scheduled: list[ScheduledRequest], positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[num_tokens] flat KV slot of every new token: block_id * block_size + offset, in one
    gather over the step's padded block tables (a fixed number of ops, whatever the batch)."""
    if not scheduled:
        return torch.empty(0, dtype=torch.long)
    width = max(len(s.block_ids) for s in scheduled)
    tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in scheduled])
    request_of_token = torch.repeat_interleave(
        torch.arange(len(scheduled)), torch.tensor([s.num_tokens for s in scheduled])
    )
    blocks = tables[request_of_token, positions // block_size]
    return blocks * block_size + positions % block_size
