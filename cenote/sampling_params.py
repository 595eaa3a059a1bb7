"""Per-request sampling parameters (vLLM-compatible field names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Literal

from cenote.errors import InvalidInputError, InvalidInputTypeError
from cenote.structured.params import StructuredOutputsParams

# Temperatures below this are treated as greedy decoding.
GREEDY_TEMPERATURE = 1e-5
# integers cross the process boundary as int64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# OpenAI's bound on logit_bias: every entry is applied to its row at every step
MAX_LOGIT_BIAS_ENTRIES = 300


class RequestOutputKind(Enum):
    """Which outputs of a generation request the front builds (vLLM's names)."""

    CUMULATIVE = 0  # every update: everything generated so far
    DELTA = 1  # every update: only what is new since the last one (streaming)
    FINAL_ONLY = 2  # only the finished result (offline calls, non-streaming answers)


class SamplingType(IntEnum):
    """How the sampler picks a row's next token."""

    GREEDY = 0  # argmax of the (penalised) logits
    RANDOM = 1  # sampled from the batch-wide random stream
    RANDOM_SEED = 2  # sampled with the request's own seeded generator


@dataclass
class SamplingParams:
    """What to generate and how; validated on construction.

    Raises ``ValueError`` (with the offending number) for out-of-range values and ``TypeError``
    for a ``stop`` of the wrong type. ``stop`` is normalised to ``list[str]`` and
    ``stop_token_ids`` to ``list[int]``.
    """

    n: int = 1  # number of completions per prompt (with a seed, completion i uses seed + i)
    temperature: float = 1.0  # softmax temperature; < 1e-5 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; 0 = off
    repetition_penalty: float = 1.0  # HF-style, on prompt + output tokens; 1 = off
    presence_penalty: float = 0.0  # OpenAI-style, on output tokens, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI-style, per occurrence in output, in [-2, 2]
    seed: int | None = None  # per-request seed: reproducible whatever the batch
    max_tokens: int | None = 16  # most tokens to generate; None: what the context has left
    min_tokens: int = 0  # EOS / stop tokens are masked until this many are generated
    stop: str | list[str] | None = None  # stop strings (excluded from output by default)
    stop_token_ids: list[int] | None = None  # extra token ids that end generation
    ignore_eos: bool = False  # keep generating past EOS
    logprobs: int | None = None  # number of top logprobs returned per sampled token
    prompt_logprobs: int | None = None  # number of top logprobs returned per prompt token
    skip_special_tokens: bool = True  # drop special tokens from the detokenized text
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    detokenize: bool = True  # produce text at all
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI)
    truncate_prompt_tokens: int | None = None  # keep this many (-1: the model's limit)
    truncation_side: Literal["left", "right"] = "left"  # which end of the prompt truncation cuts
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # which outputs are built
    structured_outputs: StructuredOutputsParams | None = None  # what the output must match

    def __post_init__(self) -> None:
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and value of the first invalid setting."""
        _check(self.n >= 1, f"n must be at least 1, got {self.n}")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
        )
        _check(
            self.truncation_side in ("left", "right"),
            f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}",
        )
        _check(self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0,
            f"repetition_penalty must be positive, got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, f"{name} must be in [-2, 2], got {value}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= 0, f"{name} must be non-negative, got {value}")
        stop_token_ids = self.stop_token_ids or []
        bad_ids = [t for t in stop_token_ids if t < 0]
        _check(not bad_ids, f"stop_token_ids must be non-negative, got {bad_ids}")
        big_ids = [t for t in stop_token_ids if t > INT64_MAX]
        _check(not big_ids, f"stop_token_ids must be below 2**63, got {big_ids}")
        for name in ("n", "max_tokens", "min_tokens", "top_k", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or value <= INT64_MAX,
                f"{name} must be at most 2**63 - 1, got {value}",
            )
        _check(
            self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
            f"seed must be a 64-bit signed integer, got {self.seed}",
        )
        num_biased = len(self.logit_bias or {})
        _check(
            num_biased <= MAX_LOGIT_BIAS_ENTRIES,
            f"logit_bias has {num_biased} entries, at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
        )
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, f"logit_bias token ids must be non-negative, got {token_id}")
            _check(-100 <= bias <= 100, f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY, RANDOM_SEED (seed set) or RANDOM."""
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as the list it is once the params are built."""
        return self.stop if isinstance(self.stop, list) else _normalize_stop(self.stop)

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 when there are none)."""
        return max((len(s) for s in self.stop_strings), default=0)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidInputError(message)


def _normalize_stop(stop: object) -> list[str]:
    """``None`` -> ``[]``, ``str`` -> ``[str]``, list/tuple of ``str`` -> list; else TypeError."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list | tuple):
        for item in stop:
            if not isinstance(item, str):
                raise InvalidInputTypeError(
                    f"stop must be a str or a list of str, got a list containing "
                    f"{type(item).__name__} ({item!r})"
                )
        return [s for s in stop if s]
    raise InvalidInputTypeError(f"stop must be a str or a list of str, got {type(stop).__name__}")
