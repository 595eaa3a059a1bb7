"""PEFT LoRA adapter folders, read and checked: ``adapter_config.json`` +
``adapter_model.safetensors`` -> each targeted projection's ``A`` and scaled ``B``.

PEFT saves ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight``
``[out, r]`` and adds ``lora_B(lora_A(x)) * scaling`` to the module's output, with
``scaling = lora_alpha / r`` (``use_rslora``: ``lora_alpha / sqrt(r)``). What cenote does not
compute the same way is refused here, with the reason: DoRA, biases, ``alpha_pattern``,
embedding adapters, full tensors outside ``modules_to_save``.

``modules_to_save`` (e.g. a fine-tuned ``classifier`` or ``score`` head) is saved by PEFT as the
module's full tensors under the base checkpoint's names; they are kept as ``saved_tensors`` and
the manager decides whether the model lets them replace its head.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

_PEFT_PREFIX = "base_model.model."
_FACTORS = (".lora_A.weight", ".lora_B.weight")
# PEFT options that change what the adapter computes beyond x @ A^T @ B^T * scaling
_REFUSED_OPTIONS = (
    "lora_bias",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "use_qalora",
    "use_bdlora",
)


@dataclass(frozen=True)
class LoRAFactors:
    """One projection's update ``x @ a.T @ b.T``."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank], scaling folded in


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter as read from its folder, before it meets a model."""

    path: Path
    rank: int  # the largest rank of its projections
    factors: dict[str, LoRAFactors]  # base checkpoint weight name (``<module>.weight``) -> update
    # ``modules_to_save`` tensors: base checkpoint name (``<module>.weight`` / ``.bias``) -> tensor
    saved_tensors: dict[str, torch.Tensor]


def read_adapter(path: str | Path, max_rank: int) -> LoRAAdapter:
    """The PEFT adapter in folder ``path``; ValueError naming what is refused (a rank above
    ``max_rank``, DoRA, biases, ...)."""
    folder = Path(path)
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {folder}: no adapter_config.json (a PEFT adapter folder?)")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    _check_config(folder, config)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise ValueError(
            f"LoRA adapter {folder}: no adapter_model.safetensors (pickled adapter_model.bin is "
            "not loaded: it can execute code)"
        )
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(weights_path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            tensors[name] = f.get_tensor(name)
    saved = _saved_tensors(tensors, config.get("modules_to_save") or [])
    factors = _pair_factors(folder, {n: t for n, t in tensors.items() if n not in saved}, config)
    if not factors and not saved:
        raise ValueError(f"LoRA adapter {folder}: adapter_model.safetensors has no lora_A/B")
    rank = max((f.a.shape[0] for f in factors.values()), default=0)
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {folder} has rank {rank}, above max_lora_rank={max_rank}; "
            f"raise --max-lora-rank to at least {rank}"
        )
    saved_tensors = {name.removeprefix(_PEFT_PREFIX): t.float() for name, t in saved.items()}
    return LoRAAdapter(folder, rank, factors, saved_tensors)


def _check_config(folder: Path, config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {folder}: peft_type {peft_type!r} is not LORA")
    if config.get("use_dora"):
        raise ValueError(
            f"LoRA adapter {folder} uses DoRA (use_dora=true), which cenote does not compute; "
            "merge it into the base model instead"
        )
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"LoRA adapter {folder} trains biases (bias={config['bias']!r}); only bias='none' "
            "adapters are supported"
        )
    if config.get("alpha_pattern"):
        raise ValueError(f"LoRA adapter {folder}: alpha_pattern is not supported")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {folder}: fan_in_fan_out (Conv1D bases) is not supported")
    for option in _REFUSED_OPTIONS:
        if config.get(option):
            raise ValueError(
                f"LoRA adapter {folder} sets {option}={config[option]!r}, which cenote does not "
                "compute; only plain LoRA on linear layers is supported"
            )
    if "lora_alpha" not in config or "r" not in config:
        raise ValueError(f"LoRA adapter {folder}: adapter_config.json lacks r or lora_alpha")


def _saved_tensors(tensors: dict[str, torch.Tensor], modules: list[str]) -> dict[str, torch.Tensor]:
    """The full tensors of ``modules_to_save`` modules: PEFT wraps every module whose dotted
    name ends with an entry (a plain string suffix: ``norm`` takes ``input_layernorm`` too) and
    saves the tensors under it by their base names."""
    saved = {}
    for name, tensor in tensors.items():
        if name.endswith(_FACTORS) or "lora_" in name:
            continue
        parts = name.removeprefix(_PEFT_PREFIX).split(".")
        prefixes = (".".join(parts[:end]) for end in range(1, len(parts)))
        if any(prefix.endswith(module) for prefix in prefixes for module in modules):
            saved[name] = tensor
    return saved


def _pair_factors(
    folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> dict[str, LoRAFactors]:
    """``lora_A`` / ``lora_B`` pairs by base weight name, ``B`` scaled; anything else refused."""
    alpha, rslora = float(config["lora_alpha"]), bool(config.get("use_rslora", False))
    embedding = next((name for name in tensors if "lora_embedding_" in name), None)
    if embedding is not None:
        raise ValueError(
            f"LoRA adapter {folder} adapts an embedding layer ({embedding!r}): embedding-layer "
            "LoRA is not supported (only lora_A / lora_B of linear layers)"
        )
    modules: set[str] = set()
    for name in tensors:
        module = next((name.removesuffix(s) for s in _FACTORS if name.endswith(s)), None)
        if module is None:
            kind = "a DoRA magnitude" if "lora_magnitude_vector" in name else "a full weight"
            raise ValueError(
                f"LoRA adapter {folder}: tensor {name!r} is {kind}, which is not supported "
                "(only lora_A / lora_B of linear layers)"
            )
        modules.add(module)
    factors = {}
    for module in sorted(modules):
        a_name, b_name = module + _FACTORS[0], module + _FACTORS[1]
        if a_name not in tensors or b_name not in tensors:
            raise ValueError(f"LoRA adapter {folder}: {module} lacks lora_A or lora_B")
        a, b = tensors[a_name], tensors[b_name]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {folder}: {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, not [r, in] and [out, r]"
            )
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        base_name = module.removeprefix(_PEFT_PREFIX) + ".weight"
        factors[base_name] = LoRAFactors(a.float(), b.float() * scaling)
    return factors
