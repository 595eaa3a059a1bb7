"""The CUDA platform: what cenote already decides for a GPU (bf16 from compute capability 8.0,
the options that have no GPU path, the KV cache sized by ``--gpu-memory-utilization``, decode
steps replayed as CUDA graphs)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from cenote.platforms.interface import (
    DEFAULT_KV_CACHE_BYTES,
    DeviceType,
    Feature,
    Platform,
)

# bf16 tensor cores start with Ampere (compute capability 8.0); below, fp16 is the fast type
_BF16_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class CudaPlatform(Platform):
    """A CUDA GPU (device 0 of this process). ``capability`` is its compute capability; None
    reads the device's at first use."""

    capability: tuple[int, int] | None = None

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[DeviceType] = "cuda"
    # vLLM's offline defaults for large GPUs: a step's device work is small next to its host
    # work, so steps are larger (docs/performance.md)
    min_token_budget: ClassVar[int] = 16384
    default_max_num_seqs: ClassVar[int] = 1024

    @property
    def compute_capability(self) -> tuple[int, int]:
        if self.capability is not None:
            return self.capability
        major, minor = torch.cuda.get_device_capability()
        return (major, minor)

    def _has(self, feature: Feature) -> bool:
        if feature == "bf16_fast":
            return self.compute_capability >= _BF16_CAPABILITY
        return feature == "cuda_graphs"

    def hardware(self) -> str:
        major, minor = self.compute_capability
        return f"GPU has compute capability {major}.{minor}"

    def default_dtype(self) -> torch.dtype:
        """bf16 on compute capability >= 8.0 (bf16 tensor cores), else fp16."""
        return torch.bfloat16 if self.supports("bf16_fast") else torch.float16

    def _check_device_options(
        self, *, num_threads: int | None, quantization: str, gpu_memory_utilization: float
    ) -> None:
        if num_threads is not None:
            raise ValueError(
                f"num_threads (--num-threads {num_threads}) sets the torch threads of CPU "
                f"compute; with device={self.name!r} the model runs on the GPU: leave "
                "num_threads unset or use device='cpu'"
            )
        if quantization in ("int8", "int4", "w8a8") and not self.supports("cpu_kernels"):
            raise ValueError(
                f"quantization={quantization!r} (--quantization) multiplies on cenote's CPU "
                f"kernels, which have no {self.name} path yet; use quantization='none' (or "
                "'auto') or device='cpu'"
            )

    def kv_cache_budget_bytes(self) -> int:
        """A quarter of the GPU's free memory, at most 1 GiB (used when the profiling step
        fails; ``num_gpu_kv_blocks`` sizes the cache otherwise)."""
        free, _ = torch.cuda.mem_get_info()
        return min(DEFAULT_KV_CACHE_BYTES, free // 4)


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
