"""Verification of drafted tokens by the target model's logits, exact at any temperature.

Each drafting request has ``k + 1`` logits rows: position ``j`` (< k) predicts the token after
draft token ``j - 1`` and is checked against draft token ``j``; the last one gives the bonus
token when every draft token is kept. Every row goes through the request's own sampling
pipeline (banned tokens, ``logit_bias``, penalties over the output *including the draft tokens
before it*, temperature, top-k/top-p, min-p), so row ``j`` is the distribution ``p_j`` plain
decoding would sample from after the accepted draft tokens.

- greedy rows keep draft tokens while they equal the argmax of ``p_j``, then append the argmax at
  the first mismatch (or the bonus row's): token for token what plain greedy decoding emits.
- random rows: the draft is deterministic (``q`` is one-hot on the draft token ``x``), so the
  rejection-sampling rule ``min(1, p/q)`` accepts ``x`` with probability ``p_j(x)``; a rejection
  samples from ``p_j`` with ``x`` removed, renormalized (``max(0, p - q)``); after ``k`` accepted
  tokens the bonus is sampled from ``p_k``. Each emitted token is distributed exactly as plain
  sampling's (Leviathan et al., 2023, appendix A.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cenote.sampling.metadata import SamplingMetadata
from cenote.sampling.sampler import (
    Argmax,
    LogprobsTensors,
    adjust_logits,
    compute_logprobs,
    gather_logprobs,
    random_sample,
    sampling_probs,
    torch_argmax,
)


@dataclass
class Verified:
    """What verification kept."""

    token_ids: list[list[int]]  # per request: accepted draft tokens, then one target token
    logprobs: LogprobsTensors | None  # [num_positions, ...] rows of every position, when asked


def verify_drafts(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    draft_token_ids: list[list[int]],
    argmax: Argmax = torch_argmax,
) -> Verified:
    """``logits`` [num_positions, vocab]: request ``r``'s ``len(draft_token_ids[r]) + 1`` rows,
    requests in order; ``metadata`` has one row per position (the request's parameters with its
    output extended by the draft tokens before that position). ``logits`` is not modified."""
    device = logits.device
    # 1) fp32 copy, raw logprobs, the request's masks / bias / penalties
    work = logits.to(torch.float32, copy=True)
    raw_logprobs = compute_logprobs(work) if metadata.max_num_logprobs is not None else None
    work = adjust_logits(work, metadata)
    # 2) the draft token each position checks; the bonus rows check none (-1)
    drafts_flat: list[int] = []
    for drafts in draft_token_ids:
        drafts_flat.extend(drafts)
        drafts_flat.append(-1)
    checked = torch.tensor(drafts_flat, dtype=torch.int64, device=device)  # [num_positions]
    is_draft = checked >= 0
    # 3) greedy rows: the target is the argmax
    targets = argmax(work) if not metadata.all_random else None  # [num_positions]
    # 4) random rows: accept x with probability p(x), else draw from p without x
    accepted = recovered = None
    if not metadata.all_greedy:
        probs = sampling_probs(work, metadata)  # [num_positions, vocab]
        safe = checked.clamp(min=0).unsqueeze(1)
        draft_probs = probs.gather(1, safe).squeeze(1)  # [num_positions]
        uniforms = _uniforms(probs.shape[0], metadata.generators, device)
        accepted = (uniforms < draft_probs) & is_draft
        residual = probs.scatter(1, safe, torch.zeros_like(safe, dtype=probs.dtype))
        residual = torch.where(is_draft.unsqueeze(1), residual, probs)
        recovered = random_sample(residual, metadata.generators, argmax)
    # 5) walk each request's positions on the host
    greedy = metadata.greedy_mask.tolist()
    target_list = targets.tolist() if targets is not None else None
    accepted_list = accepted.tolist() if accepted is not None else None
    recovered_list = recovered.tolist() if recovered is not None else None
    kept: list[list[int]] = []
    chosen: list[int] = []  # per position: the token emitted there (the draft token after it)
    start = 0
    for drafts in draft_token_ids:
        tokens: list[int] = []
        for j in range(len(drafts) + 1):
            position = start + j
            if greedy[position]:
                assert target_list is not None
                token = target_list[position]
                keep = j < len(drafts) and token == drafts[j]
            else:
                assert accepted_list is not None and recovered_list is not None
                keep = bool(accepted_list[position])
                token = drafts[j] if keep else recovered_list[position]
            tokens.append(token)
            if not keep:
                break
        chosen.extend(tokens)
        chosen.extend([0] * (len(drafts) + 1 - len(tokens)))  # positions past the first miss
        kept.append(tokens)
        start += len(drafts) + 1
    logprobs = None
    if raw_logprobs is not None and metadata.max_num_logprobs is not None:
        chosen_tensor = torch.tensor(chosen, dtype=torch.int64, device=device)
        logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, chosen_tensor)
    return Verified(token_ids=kept, logprobs=logprobs)


def _uniforms(
    num_rows: int, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """[num_rows] uniforms in [0, 1); seeded rows draw theirs from their own generator."""
    uniforms = torch.empty(num_rows, dtype=torch.float32, device=device)
    if len(generators) < num_rows:
        uniforms.uniform_()
    for row, generator in generators.items():
        uniforms[row : row + 1].uniform_(generator=generator)
    return uniforms
