"""Batch-level sampling inputs: one row per request being sampled this step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cenote.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenBias:
    """One request's ``logit_bias`` as tensors, built once when the request is first sampled."""

    token_ids: torch.Tensor  # [num_entries] int64, inside the vocabulary
    values: torch.Tensor  # [num_entries] fp32, added to those tokens' logits

    @classmethod
    def from_dict(
        cls, bias: dict[int, float], vocab_size: int, device: torch.device | str = "cpu"
    ) -> TokenBias:
        """Ids outside the vocabulary are dropped (the edge refuses them; never crash here)."""
        kept = {t: v for t, v in bias.items() if 0 <= t < vocab_size}
        return cls(
            token_ids=torch.tensor(list(kept), dtype=torch.int64, device=device),
            values=torch.tensor(list(kept.values()), dtype=torch.float32, device=device),
        )


@dataclass(frozen=True)
class BatchBias:
    """Every biased row's entries of one step, flat, for one ``index_put_``."""

    rows: torch.Tensor  # [num_entries] int64: the row of each entry
    token_ids: torch.Tensor  # [num_entries] int64
    values: torch.Tensor  # [num_entries] fp32


@dataclass(frozen=True)
class AllowedTokens:
    """The grammar-constrained rows of one step and the tokens each may take next."""

    rows: torch.Tensor  # [num_constrained] int64: rows of the step's logits
    mask: torch.Tensor  # [num_constrained, vocab_size] bool: True where the grammar allows


@dataclass
class SamplingRow:
    """What the runner knows about one request it samples for this step."""

    params: SamplingParams  # the request's sampling parameters
    prompt_token_ids: list[int]  # the whole prompt (for repetition penalty)
    output_token_ids: list[int]  # tokens generated so far (for all penalties)
    generator: torch.Generator | None = None  # the request's own generator when it has a seed
    masked_token_ids: list[int] | None = None  # banned this step (e.g. EOS before min_tokens)
    logit_bias: TokenBias | None = None  # params.logit_bias as tensors (None: built per step)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for a seeded request; the runner keeps it for the request's lifetime."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingMetadata:
    """Per-row sampling tensors for one step; built by :meth:`from_rows`.

    Optional tensors are ``None`` when no row needs the step, so the sampler skips it.
    Padded token tensors use ``vocab_size`` as the pad id.
    """

    temperature: torch.Tensor  # [num_rows] fp32; 1.0 on greedy rows (never divides by 0)
    greedy_mask: torch.Tensor  # [num_rows] bool; True where the row is decoded greedily
    all_greedy: bool  # every row is greedy: skip the random path
    all_random: bool  # no row is greedy: skip argmax
    top_k: torch.Tensor | None  # [num_rows] int64 in [1, vocab_size]; vocab_size = off
    top_p: torch.Tensor | None  # [num_rows] fp32 in (0, 1]; 1.0 = off
    min_p: torch.Tensor | None  # [num_rows] fp32 in [0, 1]; 0.0 = off
    no_penalties: bool  # no row has any penalty: skip apply_penalties
    repetition_penalties: torch.Tensor | None  # [num_rows] fp32; 1.0 = off
    presence_penalties: torch.Tensor | None  # [num_rows] fp32; 0.0 = off
    frequency_penalties: torch.Tensor | None  # [num_rows] fp32; 0.0 = off
    prompt_token_ids: torch.Tensor | None  # [num_rows, max_prompt_len] int64, pad = vocab_size
    output_token_ids: torch.Tensor | None  # [num_rows, max_output_len] int64, pad = vocab_size
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> generator
    max_num_logprobs: int | None = None  # largest `logprobs` asked for; None = none asked
    masked_token_ids: dict[int, list[int]] = field(default_factory=dict)  # row -> banned ids
    logit_bias: BatchBias | None = None  # every row's logit_bias entries; None = no row has one
    allowed: AllowedTokens | None = None  # structured outputs' rows: what their grammar allows

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def no_top_k_top_p(self) -> bool:
        return self.top_k is None and self.top_p is None

    @classmethod
    def from_rows(
        cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str = "cpu"
    ) -> SamplingMetadata:
        """Build the batch tensors; row ``i`` of the logits belongs to ``rows[i]``."""
        params = [row.params for row in rows]
        greedy = [p.is_greedy for p in params]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        # 1) temperature and the greedy / random split
        temperature = floats(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        )
        # 2) truncation: a tensor only when some random row uses it
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in random_params):
            ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
            top_k = torch.tensor(ks, dtype=torch.int64, device=device)
        if any(p.top_p < 1.0 for p in random_params):
            top_p = floats([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in random_params):
            min_p = floats([p.min_p for p in params])
        # 3) penalties (they apply to greedy rows too)
        no_penalties = all(_has_no_penalty(p) for p in params)
        penalties = {} if no_penalties else _penalty_tensors(rows, vocab_size, device)
        # 4) logprobs, seeded generators, banned tokens
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            no_penalties=no_penalties,
            repetition_penalties=penalties.get("repetition"),
            presence_penalties=penalties.get("presence"),
            frequency_penalties=penalties.get("frequency"),
            prompt_token_ids=penalties.get("prompt"),
            output_token_ids=penalties.get("output"),
            generators={
                i: row.generator
                for i, (row, g) in enumerate(zip(rows, greedy, strict=True))
                if row.generator is not None and not g
            },
            max_num_logprobs=max(asked) if asked else None,
            masked_token_ids={
                i: list(row.masked_token_ids) for i, row in enumerate(rows) if row.masked_token_ids
            },
            logit_bias=_batch_bias(rows, vocab_size, device),
        )


def _batch_bias(
    rows: list[SamplingRow], vocab_size: int, device: torch.device | str
) -> BatchBias | None:
    """The biased rows' entries, concatenated (each row's tensors are built once per request)."""
    biases = {
        i: row.logit_bias or TokenBias.from_dict(row.params.logit_bias, vocab_size, device)
        for i, row in enumerate(rows)
        if row.params.logit_bias
    }
    if not biases:
        return None
    sizes = torch.tensor([b.token_ids.numel() for b in biases.values()], device=device)
    return BatchBias(
        rows=torch.repeat_interleave(torch.tensor(list(biases), device=device), sizes),
        token_ids=torch.cat([b.token_ids for b in biases.values()]),
        values=torch.cat([b.values for b in biases.values()]),
    )


def _has_no_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


def _penalty_tensors(
    rows: list[SamplingRow], vocab_size: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Penalty values and padded prompt / output token ids for every row."""
    params = [row.params for row in rows]
    return {
        "repetition": torch.tensor(
            [p.repetition_penalty for p in params], dtype=torch.float32, device=device
        ),
        "presence": torch.tensor(
            [p.presence_penalty for p in params], dtype=torch.float32, device=device
        ),
        "frequency": torch.tensor(
            [p.frequency_penalty for p in params], dtype=torch.float32, device=device
        ),
        "prompt": pad_token_ids([row.prompt_token_ids for row in rows], vocab_size, device),
        "output": pad_token_ids([row.output_token_ids for row in rows], vocab_size, device),
    }


def pad_token_ids(
    token_ids: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Right-pad id lists to one int64 tensor ``[num_rows, max_len]`` (at least 1 column)."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((len(token_ids), max(max_len, 1)), pad_id, dtype=torch.int64)
    for i, ids in enumerate(token_ids):
        if ids:
            padded[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return padded.to(device)
