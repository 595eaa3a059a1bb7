"""Build a model on the meta device, then fill it from safetensors. Nothing is executed."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from cenote.config import ModelConfig
from cenote.kernels import ops
from cenote.models.interfaces import Model, PostLoad, QuantizedLoading
from cenote.models.layers.linear import prepack_trunk, quantize_trunk_w8a8
from cenote.models.layers.quant import keep_dense_copies, quantize_trunk, use_dot_products
from cenote.models.registry import load_model_class
from cenote.platforms import CpuPlatform, Platform

logger = logging.getLogger(__name__)


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
    """(Hugging Face name, tensor) pairs of a folder's safetensors or a GGUF file (dequantized;
    ``GGUFCheckpoint.tensors(keep_quantized=True)`` keeps its quantized tensors)."""
    if model_config.gguf is not None:
        return model_config.gguf.tensors(torch.float32)
    return iterate_weights(model_config.path)


def load_model(model_config: ModelConfig, platform: Platform | None = None) -> nn.Module:
    """The trunk of ``model_config`` with its weights, in eval mode, in the runtime dtype, its
    layers set up for ``platform`` (the engine config's; None: this machine's CPU, for a model
    loaded alone).

    A GGUF's quantized tensors stay quantized where the model supports it and the kernel is
    available (``quantization="auto"``), and a folder's linear layers are quantized when asked
    (``"int8"`` / ``"int4"``); see cenote/models/layers/quant.py."""
    model_class = load_model_class(model_config.architecture)
    with torch.device("meta"):
        model = model_class(model_config)
    if not isinstance(model, Model):
        raise TypeError(
            f"{type(model).__name__} does not declare the Model contract "
            "(cenote/models/interfaces.py)"
        )
    platform = platform or CpuPlatform()
    method = _quantization(model_config, model, platform)
    if method == "gguf":
        assert model_config.gguf is not None and isinstance(model, QuantizedLoading)
        model.prepare_quantized(model_config.gguf.quantized_names())
        model = model.to_empty(device=model_config.device)
        loaded = model.load_weights(model_config.gguf.tensors(torch.float32, keep_quantized=True))
    else:
        model = model.to_empty(device=model_config.device)  # each weight is copied in from the host
        loaded = model.load_weights(model_weights(model_config))
    missing = model.required_parameters() - loaded
    if missing:
        raise ValueError(
            f"{model_config.path}: checkpoint lacks {len(missing)} parameters, "
            f"e.g. {sorted(missing)[:5]}"
        )
    model = model.to(model_config.dtype).eval()
    if method == "gguf":
        assert isinstance(model, QuantizedLoading)
        model.finish_quantized(model_config.dtype)
    elif method in ("int8", "int4"):
        count = quantize_trunk(model, method)
        logger.info("quantized %d linear layers to %s (weight-only)", count, method)
    elif method == "w8a8":
        count = quantize_trunk_w8a8(model)
        logger.info("%d linear layers multiply as w8a8 (int8 weights and activations)", count)
    prepack_trunk(model, platform)
    if isinstance(model, PostLoad):
        model.post_load()  # after the cast: e.g. pack the LM head in the runtime dtype
    if method in ("gguf", "int8", "int4"):
        use_dot_products(model, model_config.dtype)
        keep_dense_copies(model, model_config.dtype, model_config.quantized_dense_copy)
    return model


def _quantization(model_config: ModelConfig, model: nn.Module, platform: Platform) -> str | None:
    """What ``model_config.quantization`` means for this model: "gguf" (keep the file's
    quantized tensors), "int8"/"int4" (quantize after loading), or None (dense)."""
    asked = model_config.quantization
    if asked in (None, "none"):
        return None
    if asked == "auto":
        if model_config.gguf is None or not isinstance(model, QuantizedLoading):
            return None
        if not platform.supports("cpu_kernels"):
            logger.warning(
                "%s: quantized GGUF tensors have no %s kernel yet, weights dequantized to %s",
                model_config.path.name,
                model_config.device,
                model_config.dtype,
            )
            return None
        if not ops.kernels_built():
            logger.warning(
                "%s: quantized kernel unavailable, weights dequantized to %s",
                model_config.path.name,
                model_config.dtype,
            )
            return None
        return "gguf"
    if not ops.kernels_built():
        raise RuntimeError(
            f"quantization={asked!r} needs the quantized-matmul kernel, which could not be "
            "built here (see the log); use quantization='none'"
        )
    if model_config.gguf is not None:
        raise ValueError(
            f"quantization={asked!r} applies to safetensors folders; a GGUF keeps its own "
            "quantized tensors (quantization='auto') or loads dense ('none')"
        )
    if asked == "w8a8":
        _check_w8a8(model_config, platform)
    return asked


def _check_w8a8(model_config: ModelConfig, platform: Platform) -> None:
    """w8a8 multiplies bf16 rows on int8 dot-product instructions; refuse where it cannot."""
    if model_config.dtype != torch.bfloat16:
        raise ValueError(
            f"quantization='w8a8' quantizes bf16 activations, but the dtype is "
            f"{str(model_config.dtype).removeprefix('torch.')}; use dtype='bfloat16' (or 'auto' "
            "on a CPU with native bf16)"
        )
    if not platform.supports("int8_dot_products"):
        raise ValueError(
            "quantization='w8a8' needs int8 dot products (AVX512-VNNI or AMX-INT8); this "
            f"{platform.hardware()}"
        )
    if not ops.int8_supported():
        raise RuntimeError(
            "quantization='w8a8': torch's int8 micro-kernels did not give the right product "
            "on a check here; use quantization='none'"
        )


def load_dense_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Weights of a sentence-transformers Dense module (safetensors, or a tensors-only .bin)."""
    if (folder / "model.safetensors").exists():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    if (folder / "pytorch_model.bin").exists():
        # weights_only refuses anything but tensors: no code from the folder runs
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{folder} has no Dense weights")
