"""The sampler: logits -> next token ids (+ logprobs), as a pipeline of small functions.

    compute_logprobs (raw) -> mask_tokens -> apply_logit_bias -> apply_penalties -> greedy argmax
        -> apply_temperature -> apply_top_k_top_p -> apply_min_p -> random_sample

All arithmetic is in fp32 whatever the logits dtype. Every step is row-wise, and seeded rows
draw their noise from their own generator, so a seeded request gets the same token alone or
inside any batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from cenote.kernels import ops
from cenote.sampling.metadata import AllowedTokens, BatchBias, SamplingMetadata

Argmax = Callable[[torch.Tensor], torch.Tensor]


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


@dataclass
class LogprobsTensors:
    """Logprobs of a chosen token plus the top-k alternatives, one row per position."""

    token_ids: torch.Tensor  # [num_rows, k + 1] int64: chosen token, then top-k by logprob
    logprobs: torch.Tensor  # [num_rows, k + 1] fp32, aligned with token_ids
    ranks: torch.Tensor  # [num_rows] int64: 1-based rank of the chosen token


@dataclass
class SamplerOutput:
    """What the sampler returns to the runner."""

    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler(nn.Module):
    """Turns last-position logits into next tokens according to ``SamplingMetadata``."""

    def __init__(self) -> None:
        super().__init__()
        ops.load()  # the kernels built or loaded up front, not on the first step
        self.argmax: Argmax = ops.argmax
        self.mask_allowed: MaskAllowed = mask_allowed

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` [num_rows, vocab_size]; input is not modified.

        Logprobs (when any row asks) are the log-softmax of the raw logits, before masks,
        penalties and temperature; the runner slices each row to its own ``logprobs`` count.
        """
        # 1) fp32 working copy
        source = logits
        logits = logits.to(torch.float32, copy=True)
        # 2) raw logprobs, before anything changes the logits
        raw_logprobs = None
        num_logprobs = metadata.max_num_logprobs
        if num_logprobs is not None:
            raw_logprobs = compute_logprobs(logits)
        # 3) banned tokens and penalties
        logits = adjust_logits(logits, metadata)
        if metadata.allowed is not None:
            logits = apply_allowed_tokens(logits, metadata.allowed, source, self.mask_allowed)
        # 4) choose
        sampled = sample(logits, metadata, self.argmax)
        # 5) logprobs of the chosen tokens
        logprobs = None
        if raw_logprobs is not None and num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def adjust_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Banned tokens, ``logit_bias`` and penalties on fp32 logits (in place where it can)."""
    logits = mask_tokens(logits, metadata.masked_token_ids)
    if metadata.logit_bias is not None:
        logits = apply_logit_bias(logits, metadata.logit_bias)
    if not metadata.no_penalties:
        logits = apply_penalties(logits, metadata)
    return logits


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the vocabulary."""
    return torch.log_softmax(logits.float(), dim=-1)


def mask_tokens(logits: torch.Tensor, row_to_token_ids: dict[int, list[int]]) -> torch.Tensor:
    """Set ``logits[row, token] = -inf`` for each listed token (in place; returns ``logits``).

    For EOS / stop ids before ``min_tokens`` and for bad words; ids outside the vocabulary are
    ignored.
    """
    vocab_size = logits.shape[-1]
    for row, token_ids in row_to_token_ids.items():
        ids = [t for t in token_ids if 0 <= t < vocab_size]
        if ids:
            logits[row, ids] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: BatchBias) -> torch.Tensor:
    """Add each row's bias to its listed tokens' logits, all rows in one scatter (in place;
    returns ``logits``). OpenAI's ``logit_bias``: -100 all but bans a token, +100 all but
    forces it."""
    values = bias.values.to(logits.dtype)
    logits.index_put_((bias.rows, bias.token_ids), values, accumulate=True)
    return logits


MaskAllowed = Callable[[torch.Tensor, list[int], torch.Tensor], list[bool]]


def mask_allowed(logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> list[bool]:
    """``-inf`` on the tokens each listed row's bitmask refuses, in place; whether each row kept
    a finite logit (``ops.apply_token_bitmask_``: cenote's kernel on fp32 host rows)."""
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    kept = ops.apply_token_bitmask_(logits, index, words)
    return [bool(k) for k in kept.tolist()]


def numpy_mask_allowed(logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> list[bool]:
    """``mask_allowed`` block by block in numpy (each row masked by ``_mask_row``, in place):
    the reference of the kernel's tests and benchmarks."""
    bits = words.numpy()
    kept = []
    for i, row in enumerate(rows):
        values = logits[row].numpy()  # a view: written in place
        _mask_row(values, bits[i])
        kept.append(bool(np.isfinite(values).any()))
    return kept


def apply_allowed_tokens(
    logits: torch.Tensor,
    allowed: AllowedTokens,
    source: torch.Tensor,
    mask: MaskAllowed = numpy_mask_allowed,
) -> torch.Tensor:
    """Structured outputs: ``-inf`` on the tokens a row's grammar does not allow (in place on
    fp32 CPU rows; returns ``logits``). Where the other masks (e.g. EOS before ``min_tokens``)
    leave a row no allowed token, the grammar wins: the row is the grammar's mask over its
    unmasked logits (``source``), so the sampled token is always one the grammar accepts."""
    kept = mask(logits, allowed.rows, allowed.words)
    for i, row in enumerate(allowed.rows):
        if not kept[i]:
            logits[row] = source[row].to(torch.float32)
            mask(logits, [row], allowed.words[i : i + 1])
    return logits


_BIT_SHIFTS = np.arange(32, dtype=np.int32)


def _mask_row(values: np.ndarray, words: np.ndarray) -> None:
    """``-inf`` where ``words`` (a bitmask, little-endian bits) has a 0, block by block of 32
    tokens: empty words fill their block at once, full ones are skipped, and only the mixed
    ones are unpacked. A grammar allows few tokens at most steps, so this touches little more
    than the blocks it fills (a bool mask over the whole vocabulary was slower:
    docs/performance.md, "numbers out of code comments")."""
    vocab = values.shape[0]
    num_full = min(vocab // 32, words.shape[0])
    blocks = values[: num_full * 32].reshape(num_full, 32)
    head = words[:num_full]
    blocks[head == 0] = float("-inf")
    mixed = np.flatnonzero((head != 0) & (head != -1))
    if mixed.size:
        refused = ((head[mixed, None] >> _BIT_SHIFTS) & 1) == 0  # [mixed, 32]
        part = blocks[mixed]
        part[refused] = float("-inf")
        blocks[mixed] = part
    tail = values[num_full * 32 :]  # past the whole words: a last partial word, or unknown ids
    if tail.size:
        bits = np.zeros(tail.size, dtype=bool)
        if num_full < words.shape[0]:
            word_bits = ((words[num_full] >> _BIT_SHIFTS) & 1).astype(bool)
            bits[: min(32, tail.size)] = word_bits[: tail.size]
        tail[~bits] = float("-inf")


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty (HF) on prompt + output tokens, then presence / frequency (OpenAI).

    Repetition: a seen token's logit is divided by the penalty when positive, multiplied when
    not. Presence / frequency: ``logit -= presence * (count > 0) + frequency * count`` over the
    output tokens.
    """
    num_rows, vocab_size = logits.shape
    assert metadata.prompt_token_ids is not None and metadata.output_token_ids is not None
    assert metadata.repetition_penalties is not None
    assert metadata.frequency_penalties is not None and metadata.presence_penalties is not None
    output_counts = token_counts(metadata.output_token_ids, vocab_size)  # [num_rows, vocab]
    prompt_seen = token_counts(metadata.prompt_token_ids, vocab_size) > 0
    seen = prompt_seen | (output_counts > 0)  # [num_rows, vocab]
    penalty = metadata.repetition_penalties.unsqueeze(1).expand(num_rows, vocab_size)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, penalised, logits)
    logits -= metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits -= metadata.presence_penalties.unsqueeze(1) * (output_counts > 0).float()
    return logits


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token per row [num_rows, vocab_size] fp32; id ``vocab_size`` = pad."""
    num_rows = token_ids.shape[0]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def sample(
    logits: torch.Tensor, metadata: SamplingMetadata, argmax: Argmax = torch_argmax
) -> torch.Tensor:
    """Greedy rows take the argmax; the others go through temperature, top-k/top-p, min-p."""
    if metadata.all_greedy:  # also the empty batch
        return argmax(logits)
    greedy = None if metadata.all_random else argmax(logits)
    sampled = random_sample(sampling_probs(logits, metadata), metadata.generators, argmax)
    if greedy is None:
        return sampled
    return torch.where(metadata.greedy_mask, greedy, sampled)


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows draw from: temperature, top-k/top-p, min-p, softmax."""
    logits = apply_temperature(logits, metadata.temperature)
    if not metadata.no_top_k_top_p:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    return torch.softmax(logits, dim=-1)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature [num_rows] (must be > 0)."""
    return logits / temperature.unsqueeze(1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (ties with the k-th kept) and its smallest nucleus.

    The nucleus is the set of most likely tokens whose probability mass reaches ``p``; at least
    one token always survives. Dropped tokens become ``-inf``. ``k = vocab_size`` / ``p = 1``
    disable a row's truncation.
    """
    if top_k is None and top_p is None:
        return logits
    logits_sort, sort_index = logits.sort(dim=-1, descending=False)  # ascending
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth_column = (vocab_size - top_k.clamp(1, vocab_size)).unsqueeze(1)
        kth_value = logits_sort.gather(1, kth_column)  # [num_rows, 1]
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    if top_p is not None:
        cumulative = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # ascending mass
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        logits_sort.masked_fill_(drop, float("-inf"))
    return logits_sort.scatter(-1, sort_index, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p * max probability`` of their row."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def random_sample(
    probs: torch.Tensor, generators: dict[int, torch.Generator], argmax: Argmax = torch_argmax
) -> torch.Tensor:
    """Exponential-race sampling: ``argmax(probs / q)`` with ``q ~ Exponential(1)``.

    Equivalent to drawing from ``probs``. Row ``i`` in ``generators`` draws its ``q`` from its
    own generator only, so its result does not depend on the other rows.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return argmax(probs.div(q))


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """The logprob and rank of ``token_ids`` [num_rows] plus each row's top ``num_logprobs``."""
    num_logprobs = min(num_logprobs, logprobs.shape[-1])  # the edge bounds it; never crash here
    topk_logprobs, topk_ids = torch.topk(logprobs, num_logprobs, dim=-1)
    token_ids = token_ids.to(torch.int64).unsqueeze(1)  # [num_rows, 1]
    token_logprobs = logprobs.gather(-1, token_ids)  # [num_rows, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # [num_rows]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, topk_ids], dim=1),
        logprobs=torch.cat([token_logprobs, topk_logprobs], dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Prompt logprobs: ``logits[i]`` [num_positions, vocab] predicts ``next_token_ids[i]``.

    Raw log-softmax in fp32 (no penalties or temperature), same layout as sampled logprobs.
    """
    return gather_logprobs(compute_logprobs(logits), num_logprobs, next_token_ids)
