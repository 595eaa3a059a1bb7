"""The CPU platform: its vector features, read once per process, decide the default dtype and
which fast paths exist (DESIGN.md section 4: bf16 where the CPU multiplies it natively, fp32 on
AVX2-only CPUs, where bf16 is ~70x slower)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from cenote.kernels.build import cpu_features
from cenote.platforms.interface import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_BYTES,
    DeviceType,
    Feature,
    Platform,
)


@functools.cache
def _this_cpu() -> frozenset[str]:
    return frozenset(cpu_features())


@dataclass(frozen=True)
class CpuPlatform(Platform):
    """The host CPU. ``flags`` are its ``/proc/cpuinfo`` features as ``cpu_features()`` names
    them (avx2, avx512f, avx512_bf16, avx512_vnni, amx_bf16, amx_int8, ...); None reads this
    machine's."""

    flags: frozenset[str] | None = None

    name: ClassVar[str] = "cpu"
    device_type: ClassVar[DeviceType] = "cpu"
    min_token_budget: ClassVar[int] = 8192
    default_max_num_seqs: ClassVar[int] = 256

    @property
    def cpu_flags(self) -> frozenset[str]:
        """The CPU's features: ``flags``, or this machine's (read once per process)."""
        return self.flags if self.flags is not None else _this_cpu()

    def _has(self, feature: Feature) -> bool:
        flags = self.cpu_flags
        if feature == "bf16_fast":
            return bool(flags & {"avx512_bf16", "amx_bf16"})
        if feature == "residual_add_in_norm":
            # pays off without AMX (docs/performance.md); AMX machines, not measured, keep
            # oneDNN's epilogue
            return "avx512_bf16" in flags and "amx_bf16" not in flags
        if feature == "int8_dot_products":
            return bool(flags & {"avx512_vnni", "amx_int8"})
        return feature == "cpu_kernels"

    def hardware(self) -> str:
        return f"CPU has {', '.join(sorted(self.cpu_flags)) or 'none of its vector features'}"

    def default_dtype(self) -> torch.dtype:
        """bf16 where the CPU multiplies it natively (AVX512-bf16 or AMX), else fp32."""
        return torch.bfloat16 if self.supports("bf16_fast") else torch.float32

    def _check_device_options(
        self, *, num_threads: int | None, quantization: str, gpu_memory_utilization: float
    ) -> None:
        if gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} (--gpu-memory-utilization) "
                "sizes the KV cache on a GPU; with device='cpu' the cache is sized by "
                "kv_cache_memory_bytes (--kv-cache-memory-bytes): leave it unset or use "
                "device='cuda'"
            )

    def kv_cache_budget_bytes(self) -> int:
        """A quarter of the host memory available now, at most 1 GiB."""
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            available = DEFAULT_KV_CACHE_BYTES
        return min(DEFAULT_KV_CACHE_BYTES, available // 4)
