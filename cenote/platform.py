"""The device seam: which device the engine runs on, and what that decides (the default dtype,
which options exist, whether cenote's CPU kernels may take a tensor).

Resolved once at the edge (``EngineArgs.create_engine_config``); the rest of the engine reads
``ModelConfig.device`` or the device of the tensors it is handed, never asks torch again.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal, get_args

import torch

DeviceName = Literal["auto", "cpu", "cuda"]
DEVICE_NAMES: tuple[str, ...] = get_args(DeviceName)

# bf16 tensor cores start with Ampere (compute capability 8.0); below, fp16 is the fast type
_CUDA_BF16_CAPABILITY = (8, 0)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default fraction of the GPU's memory


def resolve_device(name: str) -> Literal["cpu", "cuda"]:
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


def cuda_default_dtype() -> torch.dtype:
    """bf16 on compute capability >= 8.0 (bf16 tensor cores), else fp16."""
    capability = torch.cuda.get_device_capability()
    return torch.bfloat16 if capability >= _CUDA_BF16_CAPABILITY else torch.float16


def check_device_options(
    device: str,
    *,
    num_threads: int | None,
    quantization: str,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> None:
    """Refuse the options that have no path on ``device`` (ValueError naming the option). A
    GGUF's quantized tensors with quantization='auto' load dense there (the loader decides)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            "gpu_memory_utilization (--gpu-memory-utilization) is the fraction of the GPU's "
            f"memory the engine may use: it must be in (0, 1], got {gpu_memory_utilization}"
        )
    if device == "cpu":
        if gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} (--gpu-memory-utilization) "
                "sizes the KV cache on a GPU; with device='cpu' the cache is sized by "
                "kv_cache_memory_bytes (--kv-cache-memory-bytes): leave it unset or use "
                "device='cuda'"
            )
        return
    if num_threads is not None:
        raise ValueError(
            f"num_threads (--num-threads {num_threads}) sets the torch threads of CPU compute; "
            f"with device={device!r} the model runs on the GPU: leave num_threads unset or use "
            "device='cpu'"
        )
    if quantization in ("int8", "int4", "w8a8"):
        raise ValueError(
            f"quantization={quantization!r} (--quantization) multiplies on cenote's CPU "
            f"kernels, which have no {device} path yet; use quantization='none' (or 'auto') "
            "or device='cpu'"
        )


def num_gpu_kv_blocks(
    *,
    total_bytes: int,
    utilization: float,
    peak_bytes: int,
    activation_bytes: int,
    free_bytes: int,
    graph_reserve_bytes: int,
    bytes_per_block: int,
) -> int:
    """KV-cache blocks that fit in ``utilization`` of the GPU's ``total_bytes`` next to this
    engine's profiled ``peak_bytes`` (its weights + one largest step) and the memory its CUDA
    graphs will take (vLLM's ``--gpu-memory-utilization``), and in the ``free_bytes`` the GPU
    has now, less what the next largest step (``activation_bytes``) and the graphs will take
    (another engine or process may hold the rest). Fewer than one block is a ValueError with
    the numbers and the options that fix it."""
    budget = int(total_bytes * utilization)
    by_fraction = budget - peak_bytes - graph_reserve_bytes
    by_free = free_bytes - activation_bytes - graph_reserve_bytes
    num_blocks = max(0, min(by_fraction, by_free) // bytes_per_block)
    if num_blocks >= 1:
        return num_blocks
    gib = 1 << 30
    if by_free < by_fraction:
        raise ValueError(
            f"no room for the KV cache: the GPU has {free_bytes / gib:.2f} GiB free of "
            f"{total_bytes / gib:.2f} GiB (other engines or processes hold the rest), and one "
            f"step's activations take {activation_bytes / gib:.2f} GiB and CUDA graphs "
            f"{graph_reserve_bytes / gib:.2f} GiB, leaving less than one block of "
            f"{bytes_per_block / (1 << 20):.1f} MiB; free the GPU, lower the other engines' "
            "--gpu-memory-utilization, or lower --max-num-batched-tokens"
        )
    # the least fraction with room for one block, rounded up to what the message shows
    least_bytes = peak_bytes + graph_reserve_bytes + bytes_per_block
    needed = math.ceil(least_bytes / total_bytes * 1000) / 1000
    raise_it = (
        f"raise --gpu-memory-utilization (at least {needed:.3f}), "
        if needed <= 1
        else "the GPU cannot hold it at any utilization: "
    )
    raise ValueError(
        f"no room for the KV cache: gpu_memory_utilization={utilization} of the GPU's "
        f"{total_bytes / gib:.2f} GiB is {budget / gib:.2f} GiB, but the weights and one "
        f"step's activations peak at {peak_bytes / gib:.2f} GiB and CUDA graphs take "
        f"{graph_reserve_bytes / gib:.2f} GiB, leaving less than one block of "
        f"{bytes_per_block / (1 << 20):.1f} MiB; {raise_it}lower --max-num-batched-tokens or "
        "--max-num-seqs, or pass --enforce-eager (no graphs)"
    )


def uses_cuda_graphs(device: str, enforce_eager: bool) -> bool:
    """Whether all-decode steps replay CUDA graphs (runner/decode_graphs.py): on CUDA unless
    ``enforce_eager``; the CPU runs every step eagerly (its decode stack is one C++ call)."""
    return device == "cuda" and not enforce_eager


def runs_cpu_kernels(*tensors: torch.Tensor) -> bool:
    """Whether cenote's C++ kernels may take these tensors: all on the CPU. The one device
    decision of every kernel call site (the kernels read raw host pointers)."""
    return all(t.device.type == "cpu" for t in tensors)


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors of one dtype on ``device`` through one copy: packed into one pinned buffer
    (CUDA; torch's caching host allocator keeps it until the copy is done), copied without
    blocking the host, handed back as views of the one device tensor. On the host: the tensors
    themselves."""
    if device.type == "cpu":
        return list(tensors)
    flat, sizes = pack(tensors, pin_memory=device.type == "cuda")
    return unpack(flat.to(device, non_blocking=True), sizes, tensors)


def pack(
    tensors: Sequence[torch.Tensor], *, pin_memory: bool = False
) -> tuple[torch.Tensor, list[int]]:
    """The tensors' elements end to end in one new host tensor, and each one's count."""
    assert all(t.dtype == tensors[0].dtype for t in tensors)  # one buffer, one dtype
    sizes = [t.numel() for t in tensors]
    flat = torch.empty(sum(sizes), dtype=tensors[0].dtype, pin_memory=pin_memory)
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    return flat, sizes


def unpack(
    flat: torch.Tensor, sizes: list[int], like: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``pack``'s inverse: views of ``flat`` shaped as ``like``."""
    ends = list(itertools.accumulate(sizes))
    return [
        flat[end - size : end].view(t.shape) for end, size, t in zip(ends, sizes, like, strict=True)
    ]
