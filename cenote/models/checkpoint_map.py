"""Strict checkpoint loading by an explicit name map: every checkpoint tensor has a slot (or is
declared unused), and a tensor that is missing or unexpected is named as the checkpoint names it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from cenote.models.weights import copy_weight


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: a parameter, or one row block of a fused one."""

    param: str  # our parameter name
    shard: int | None = None  # row block of a fused parameter (q, k, v -> 0, 1, 2)
    num_shards: int = 1  # equal row blocks of the fused parameter


@dataclass(frozen=True)
class LinearSlot:
    """Where a checkpoint projection lives in a model: a linear module and the block of its
    output rows it fills (a fused q/k/v or gate/up linear holds several). LoRA adapters on that
    projection update exactly these rows (cenote/lora)."""

    module: str  # our linear module's name
    start: int  # first output row
    end: int  # one past the last


@dataclass(frozen=True)
class CheckpointMap:
    """Checkpoint name -> slot of one model. ``prefixes`` are stripped from checkpoint names
    first (a trunk saved inside a task model: ``mpnet.``, ``distilbert.``); ``unused`` are
    name prefixes of tensors the model has no use for (an unused pooler, position-id buffers)."""

    slots: dict[str, Slot]  # checkpoint name (without prefix) -> slot
    prefixes: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()

    def key(self, name: str) -> str:
        """A checkpoint name without its trunk prefix."""
        for prefix in self.prefixes:
            if name.startswith(prefix):
                return name[len(prefix) :]
        return name

    def load(self, model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint into ``model``; returns the names loaded (compare with
        ``required()``). Raises on a tensor with no slot, naming it."""
        params = dict(model.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            key = self.key(name)
            slot = self.slots.get(key)
            if slot is None:
                if self.unused and key.startswith(self.unused):
                    continue
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(model).__name__}; "
                    "does config.json name the right architecture?"
                )
            target: torch.Tensor = params[slot.param]
            if slot.shard is not None:
                size = target.shape[0] // slot.num_shards
                target = target[slot.shard * size : (slot.shard + 1) * size]
            copy_weight(target, tensor, name)
            loaded.add(key)
        return loaded

    def required(self) -> set[str]:
        return set(self.slots)


def linear_slots(checkpoint: str, param: str, bias: bool = True) -> dict[str, Slot]:
    """``<checkpoint>.weight`` / ``.bias`` -> ``<param>.weight`` / ``.bias``."""
    kinds = ("weight", "bias") if bias else ("weight",)
    return {f"{checkpoint}.{kind}": Slot(f"{param}.{kind}") for kind in kinds}


def fused_slots(checkpoints: list[str], param: str) -> dict[str, Slot]:
    """Separate projections (q, k, v) loaded as row blocks of one fused linear ``param``."""
    slots = {}
    for shard, checkpoint in enumerate(checkpoints):
        for kind in ("weight", "bias"):
            slots[f"{checkpoint}.{kind}"] = Slot(f"{param}.{kind}", shard, len(checkpoints))
    return slots
