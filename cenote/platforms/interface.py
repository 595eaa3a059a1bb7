"""What a device decides for the engine: the ``Platform`` contract.

One platform object is resolved at the edge (``EngineArgs.create_engine_config`` through
``resolve_platform``) and held by ``EngineConfig.platform``; the core, the loader and the runner
ask it, never torch or ``/proc/cpuinfo``. Ops still dispatch on their tensors' device
(``kernels/ops.py``); the platform answers the questions a tensor cannot: which dtype is fast,
how much memory the KV cache may take, which threads run, which features exist.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import ClassVar, Literal, get_args

import torch

DeviceName = Literal["auto", "cpu", "cuda"]
DEVICE_NAMES: tuple[str, ...] = get_args(DeviceName)
DeviceType = Literal["cpu", "cuda"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default fraction of the GPU's memory
# upper bound of the KV cache when no budget is given (~46k tokens of SmolLM2 in bf16)
DEFAULT_KV_CACHE_BYTES = 1 << 30

Feature = Literal[
    # bf16 matmuls are the fast path (CPU: AVX512-bf16 or AMX; CUDA: bf16 tensor cores)
    "bf16_fast",
    # a residual add followed by a LayerNorm runs in the norm's kernel, not the matmul's
    # oneDNN epilogue (LayerNorm.add_normalize_; docs/performance.md)
    "residual_add_in_norm",
    # int8 x int8 dot products for w8a8 (AVX512-VNNI or AMX-INT8)
    "int8_dot_products",
    # cenote's C++ kernels (they read host pointers): quantized weights, fused CPU ops
    "cpu_kernels",
    # all-decode steps may replay captured graphs (runner/decode_graphs.py)
    "cuda_graphs",
]
FEATURES: tuple[str, ...] = get_args(Feature)


class Platform(ABC):
    """One device kind and what it decides. Subclasses are frozen dataclasses whose hardware
    facts (CPU flags, compute capability) may be given (tests fake a machine) or left None
    (read from this process's machine at first use, so a config sent to another process or
    node answers for the machine it runs on)."""

    name: ClassVar[str]  # "cpu", "cuda": what --device names
    device_type: ClassVar[DeviceType]  # where weights, KV cache and step tensors live
    # default step limits: the token budget (raised to max_model_len when longer) and requests
    min_token_budget: ClassVar[int]
    default_max_num_seqs: ClassVar[int]

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    # ---- features -----------------------------------------------------------------------------

    def features(self) -> frozenset[Feature]:
        """The features this device has (``Feature``)."""
        return frozenset(feature for feature in get_args(Feature) if self._has(feature))

    def supports(self, feature: Feature) -> bool:
        """Whether this device has ``feature``; an unknown name is a ValueError (a typo would
        otherwise read as "no")."""
        if feature not in FEATURES:
            raise ValueError(f"unknown platform feature {feature!r}; known: {', '.join(FEATURES)}")
        return self._has(feature)

    @abstractmethod
    def _has(self, feature: Feature) -> bool:
        """Whether this device has ``feature`` (a known name), reading only the facts it needs."""

    @abstractmethod
    def hardware(self) -> str:
        """The facts its features come from, as error messages name them ("CPU has avx2,
        fma", "GPU has compute capability 9.0")."""

    # ---- dtype --------------------------------------------------------------------------------

    @abstractmethod
    def default_dtype(self) -> torch.dtype:
        """The trunk's dtype for ``dtype='auto'``: the fast one here whose fidelity holds."""

    def resolve_dtype(self, dtype: DTypeName | torch.dtype) -> torch.dtype:
        """``auto`` -> ``default_dtype()``; a name -> its torch dtype (an explicit one wins)."""
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype == "auto":
            return self.default_dtype()
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]

    # ---- options ------------------------------------------------------------------------------

    def check_options(
        self,
        *,
        num_threads: int | None,
        quantization: str,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    ) -> None:
        """Refuse the options that have no path here (ValueError naming the option)."""
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                "gpu_memory_utilization (--gpu-memory-utilization) is the fraction of the GPU's "
                f"memory the engine may use: it must be in (0, 1], got {gpu_memory_utilization}"
            )
        self._check_device_options(
            num_threads=num_threads,
            quantization=quantization,
            gpu_memory_utilization=gpu_memory_utilization,
        )

    @abstractmethod
    def _check_device_options(
        self, *, num_threads: int | None, quantization: str, gpu_memory_utilization: float
    ) -> None:
        """The device's own refusals (``check_options`` has checked the ranges)."""

    # ---- memory -------------------------------------------------------------------------------

    @abstractmethod
    def kv_cache_budget_bytes(self) -> int:
        """The KV cache's bytes when no option sizes it: a quarter of what this device has
        available now, at most ``DEFAULT_KV_CACHE_BYTES``."""

    # ---- threads ------------------------------------------------------------------------------

    def pin_threads(self, num_threads: int | None, cpu_ids: tuple[int, ...] | None) -> None:
        """Run this process on ``cpu_ids`` (None: wherever it may) with ``num_threads`` torch
        threads (None: the process's setting). The engine core's compute threads are set on
        purpose (DESIGN.md: helper threads must not steal the compute cores)."""
        if cpu_ids is not None:
            os.sched_setaffinity(0, cpu_ids)
        if num_threads is not None:
            torch.set_num_threads(num_threads)


def uses_cuda_graphs(platform: Platform, enforce_eager: bool) -> bool:
    """Whether all-decode steps replay graphs (runner/decode_graphs.py): where the platform has
    them, unless ``enforce_eager``; the CPU runs every step eagerly (its decode stack is one C++
    call)."""
    return platform.supports("cuda_graphs") and not enforce_eager
