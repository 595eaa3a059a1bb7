"""Long inputs embedded in windows instead of cut (``long_input="chunk"``): a text longer than
the model's window is split into windows of at most ``max_model_len`` tokens that overlap by
``chunk_overlap``, each framed like the whole text (its special tokens and instruction prompt
in front, its closing special tokens behind), each pooled as a request of its own in the same
engine steps as any other request, then joined into one embedding.

Joining: the token-weighted mean of the windows' embeddings, taken before matryoshka truncation
and normalization (applied once, on the joined vector). With MEAN pooling and no non-linear
projection this is the mean over every token of every window (equal to the whole-sequence mean
where the model has no positional limit; tokens in an overlap count once per window); CLS and
LAST pooling give the token-weighted mean of each window's first / last-token vector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cenote.errors import InvalidInputError


@dataclass(frozen=True)
class ChunkPlan:
    """How the windows of one request join: each window's weight (its pooled tokens), then the
    request's own truncation and normalization."""

    weights: tuple[int, ...]  # per window, in order
    dimensions: int | None  # matryoshka truncation of the joined vector
    normalize: bool  # L2-normalize the joined vector


def split_windows(
    ids: Sequence[int], head: int, tail: int, max_len: int, overlap: int, index: int
) -> list[list[int]]:
    """``ids`` (``head`` framing tokens in front: specials and instruction prompt; ``tail``
    closing specials behind) as windows of at most ``max_len`` tokens, each with the frame, whose
    bodies overlap by ``overlap`` tokens. ``index``: the prompt's position, for errors."""
    room = max_len - head - tail
    if room <= overlap:
        raise InvalidInputError(
            f"prompt {index}: a window of max_model_len={max_len} tokens holds {head} + {tail} "
            f"framing tokens (special tokens, instruction prompt), leaving {max(room, 0)} for "
            f"text, which must be more than chunk_overlap={overlap}"
        )
    front, body, back = list(ids[:head]), ids[head : len(ids) - tail], list(ids[len(ids) - tail :])
    return [front + list(body[a:b]) + back for a, b in window_spans(len(body), room, overlap)]


def window_spans(length: int, room: int, overlap: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the windows of at most ``room`` tokens over ``length`` tokens, each
    sharing ``overlap`` with the one before (``room > overlap``); at least one window."""
    spans, start = [], 0
    while True:
        end = min(start + room, length)
        spans.append((start, end))
        if end >= length:
            return spans
        start = end - overlap


def join_windows(outputs: Sequence[torch.Tensor], plan: ChunkPlan) -> torch.Tensor:
    """One embedding from the windows' un-normalized embeddings (``[hidden]`` each)."""
    weights = torch.tensor(plan.weights, dtype=torch.float32)
    stacked = torch.stack([out.float() for out in outputs])  # [num_windows, hidden]
    joined = (stacked * weights[:, None]).sum(0) / weights.sum()
    if plan.dimensions is not None:
        joined = joined[: plan.dimensions]
    return F.normalize(joined, p=2, dim=-1) if plan.normalize else joined
