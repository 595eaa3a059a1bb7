"""The device seam (DESIGN.md "Devices through one seam"): one ``Platform`` per device kind,
resolved once at the edge and held by ``EngineConfig.platform``.

- ``interface.py``: the ``Platform`` contract (features, dtype, options, KV-cache budget,
  threads) and the option names;
- ``cpu.py``: ``CpuPlatform``, decided by the CPU's vector features;
- ``cuda.py``: ``CudaPlatform``, decided by the compute capability, and the KV blocks
  ``--gpu-memory-utilization`` leaves;
- ``transfer.py``: step tensors onto the device, and whether C++ kernels may take a tensor.
"""

from __future__ import annotations

import torch

from cenote.platforms.cpu import CpuPlatform
from cenote.platforms.cuda import CudaPlatform, num_gpu_kv_blocks
from cenote.platforms.interface import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_BYTES,
    DEVICE_NAMES,
    FEATURES,
    DeviceName,
    DeviceType,
    DTypeName,
    Feature,
    Platform,
    uses_cuda_graphs,
)
from cenote.platforms.transfer import pack, runs_cpu_kernels, to_device, unpack


def resolve_device(name: str) -> DeviceType:
    """``auto`` -> ``cuda`` when torch sees a CUDA device, else ``cpu``; ``cuda`` without one is
    refused (naming the option)."""
    if name not in DEVICE_NAMES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_NAMES)}, got {name!r}")
    available = torch.cuda.is_available()
    if name == "auto":
        return "cuda" if available else "cpu"
    if name == "cuda" and not available:
        raise ValueError(
            "device='cuda' (--device cuda) but torch sees no CUDA device (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); use "
            "device='cpu' or 'auto'"
        )
    return "cuda" if name == "cuda" else "cpu"


def resolve_platform(device: str) -> Platform:
    """The platform of ``device`` (auto / cpu / cuda; ``resolve_device`` refuses what torch
    cannot run). Called at the edge; the engine reads ``EngineConfig.platform`` after."""
    if resolve_device(device) == "cuda":
        return CudaPlatform()
    return CpuPlatform()


__all__ = [
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DEFAULT_KV_CACHE_BYTES",
    "DEVICE_NAMES",
    "FEATURES",
    "CpuPlatform",
    "CudaPlatform",
    "DTypeName",
    "DeviceName",
    "DeviceType",
    "Feature",
    "Platform",
    "num_gpu_kv_blocks",
    "pack",
    "resolve_device",
    "resolve_platform",
    "runs_cpu_kernels",
    "to_device",
    "unpack",
    "uses_cuda_graphs",
]
