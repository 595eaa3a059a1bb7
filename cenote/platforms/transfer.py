"""Where step tensors go: the host-to-device copy of a step's index tensors (one packed,
pinned, non-blocking copy) and the one device decision of every C++ kernel call site."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


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
