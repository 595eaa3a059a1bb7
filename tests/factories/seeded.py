"""Seeded random weights: noise on every parameter (norms and biases too), so a weight that is
loaded into the wrong place, or not at all, changes the output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers


def perturb(model: torch.nn.Module, seed: int | None = None) -> torch.nn.Module:
    """``model`` in fp32 and eval mode with noise added to every parameter (the generator
    seeded with ``seed`` first, when given)."""
    if seed is not None:
        torch.manual_seed(seed)
    model = model.float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def random_model(class_name: str, config: Any, seed: int, **kwargs: Any) -> torch.nn.Module:
    """transformers' ``class_name`` built from ``config`` with the generator seeded first
    (initial weights and noise both follow from ``seed``)."""
    torch.manual_seed(seed)
    return perturb(getattr(transformers, class_name)(config, **kwargs))


def hf_config(class_name: str, *layers: dict) -> Any:
    """transformers' ``class_name`` config from dicts merged left to right."""
    merged: dict = {}
    for layer in layers:
        merged.update(layer)
    return getattr(transformers, class_name)(**merged)


def set_config(folder: Path, **entries: Any) -> None:
    """Add entries to a saved config.json."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(entries)
    path.write_text(json.dumps(config))
