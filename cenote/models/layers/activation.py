"""Activation functions named as in Hugging Face configs, and the gated MLPs' ``act(gate) * up``
of a fused gate/up projection (``SiluAndMul`` on ``ops.silu_and_mul``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cenote.kernels import ops

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of ``gate_up [T, 2 * intermediate]`` -> ``[T, intermediate]``, each step
    rounded to the dtype as torch does."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(gate_up)


class ActAndMul(nn.Module):
    """``act(gate) * up`` of a fused gate/up projection, for any other activation."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.act = act

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


def gated_activation(name: str) -> nn.Module:
    """The ``act(gate) * up`` layer of the activation called ``name``."""
    act = get_activation(name)
    return SiluAndMul() if act is F.silu else ActAndMul(act)
