"""Build a model on the meta device, then fill it from safetensors. Nothing is executed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from cenote.config import ModelConfig
from cenote.models.interfaces import PostLoad
from cenote.models.layers.linear import prepack_trunk
from cenote.models.registry import load_model_class


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint files of a folder: one ``model.safetensors`` or the shards of its index."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(
            f"{model_dir} has no safetensors weights (model.safetensors or an index); "
            "pickled checkpoints are not loaded because they can execute code"
        )
    return found


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


def model_weights(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) pairs of a folder's safetensors or a GGUF file (dequantized)."""
    if model_config.gguf is not None:  # the file opened once, by the config
        return model_config.gguf.tensors(torch.float32)
    return iterate_weights(model_config.path)


def load_model(model_config: ModelConfig) -> nn.Module:
    """The trunk of ``model_config`` with its weights, in eval mode, in the runtime dtype."""
    model_class = load_model_class(model_config.architecture)
    with torch.device("meta"):
        model = model_class(model_config)
    model = model.to_empty(device="cpu")
    loaded = model.load_weights(model_weights(model_config))
    missing = model.required_parameters() - loaded
    if missing:
        raise ValueError(
            f"{model_config.path}: checkpoint lacks {len(missing)} parameters, "
            f"e.g. {sorted(missing)[:5]}"
        )
    model = model.to(model_config.dtype).eval()
    prepack_trunk(model)
    if isinstance(model, PostLoad):
        model.post_load()  # after the cast: e.g. pack the LM head in the runtime dtype
    return model


def load_dense_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Weights of a sentence-transformers Dense module (safetensors, or a tensors-only .bin)."""
    if (folder / "model.safetensors").exists():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    if (folder / "pytorch_model.bin").exists():
        # weights_only refuses anything but tensors: no code from the folder runs
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{folder} has no Dense weights")
