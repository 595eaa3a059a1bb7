"""Copying checkpoint tensors into parameters, shape-checked (``copy_`` would broadcast)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


def load_by_name(
    module: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    map_name: Callable[[str], str | None],
) -> set[str]:
    """Copy each checkpoint tensor into the parameter ``map_name`` names (None: not ours, e.g.
    another head's tensor); returns the names of the parameters loaded."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        target = map_name(name)
        if target is None:
            continue
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} maps to unknown parameter {target!r}")
        copy_weight(params[target], tensor, name)
        loaded.add(target)
    return loaded
