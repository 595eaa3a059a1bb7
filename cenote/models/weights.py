"""Copying checkpoint tensors into parameters, shape-checked (``copy_`` would broadcast)."""

from __future__ import annotations

import torch


def copy_weight(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """``target.copy_(tensor)``, refusing a checkpoint tensor of the wrong shape."""
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(target.shape)}; does config.json match the weights?"
        )
    with torch.no_grad():
        target.copy_(tensor)
