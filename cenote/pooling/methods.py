"""Pooling methods: how the hidden states of one prompt become one vector (or one per token)."""

from __future__ import annotations

from typing import Literal, get_args

import torch

from cenote.pooling.metadata import PoolingMetadata

PoolingMethod = Literal["cls", "mean", "last", "all", "step"]
POOLING_METHODS: tuple[PoolingMethod, ...] = get_args(PoolingMethod)


def parse_pooling_method(name: str) -> PoolingMethod:
    """``name`` as a pooling method; an unknown one is an error listing the methods."""
    for method in POOLING_METHODS:
        if method == name:
            return method
    raise ValueError(f"unknown pooling method {name!r}; supported: {', '.join(POOLING_METHODS)}")


def pool_cls(hidden: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
    starts = torch.tensor(metadata.start_loc[:-1], device=hidden.device)
    return hidden[starts].float()  # [num_requests, hidden]


def pool_last(hidden: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
    ends = torch.tensor(metadata.start_loc[1:], device=hidden.device) - 1
    return hidden[ends].float()  # [num_requests, hidden]


def pool_mean(hidden: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
    """Mean over each prompt's tokens, accumulated in fp32 whatever the model dtype."""
    device = hidden.device
    sums = torch.zeros(metadata.num_requests, hidden.shape[-1], dtype=torch.float32, device=device)
    sums.index_add_(0, metadata.segment_ids(device), hidden.float())
    lens = torch.tensor(metadata.prompt_lens, dtype=torch.float32, device=device).unsqueeze(1)
    return sums / lens  # [num_requests, hidden]


def pool_all(hidden: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
    return list(torch.split(hidden.float(), metadata.prompt_lens))  # [prompt_len, hidden] each


def pool_step(
    hidden: torch.Tensor, metadata: PoolingMetadata, default_step_tag_id: int | None = None
) -> list[torch.Tensor]:
    """Process reward: the rows whose token is the request's ``step_tag_id``, else the model's
    ``default_step_tag_id`` (all rows if neither is set)."""
    out = []
    for rows, params, token_ids in zip(
        torch.split(hidden.float(), metadata.prompt_lens),
        metadata.pooling_params,
        metadata.prompt_token_ids,
        strict=True,
    ):
        step_tag_id = params.step_tag_id if params.step_tag_id is not None else default_step_tag_id
        if step_tag_id is not None:
            rows = rows[torch.tensor(token_ids, device=rows.device) == step_tag_id]
        out.append(rows)
    return out


def pool_after_instructions(
    method: PoolingMethod, hidden: torch.Tensor, metadata: PoolingMetadata
) -> torch.Tensor:
    """CLS or MEAN over the rows after each request's instruction prompt
    (``params.instruction_length``), as sentence-transformers pools with
    ``include_prompt=false``: the first row after it (row 0 when none is left), the mean of the
    rows after it (zeros when none is left)."""
    assert method in ("cls", "mean"), method
    pooled = []
    for rows, params in zip(
        torch.split(hidden, metadata.prompt_lens), metadata.pooling_params, strict=True
    ):
        rest = rows[params.instruction_length :].float()  # [rows after the instruction, hidden]
        if method == "cls":
            pooled.append(rest[0] if len(rest) else rows[0].float())
        else:
            pooled.append(rest.sum(0) / len(rest) if len(rest) else rest.new_zeros(rows.shape[1]))
    return torch.stack(pooled)  # [num_requests, hidden]


SEQUENCE_METHODS = {"cls": pool_cls, "mean": pool_mean, "last": pool_last}
TOKEN_METHODS = {"all": pool_all, "step": pool_step}
