"""GGUF tensors dequantized to float32 in Hugging Face shape, for the types cenote reads."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from cenote.models.formats.gguf_file import GGUFError

SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)


def check_tensor_type(tensor: ReaderTensor) -> None:
    """Refuse a tensor of a type cenote cannot read, naming it and the supported types."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise GGUFError(
            f"tensor {tensor.name} has type {tensor.tensor_type.name}; supported: "
            f"{sorted(t.name for t in SUPPORTED_TENSOR_TYPES)}"
        )


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """Dequantize one GGUF tensor to float32 in Hugging Face shape (GGUF lists dims reversed)."""
    check_tensor_type(tensor)
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return torch.from_numpy(values.reshape(shape).copy())
