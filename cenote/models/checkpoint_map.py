"""One way to load weights: a model declares a ``CheckpointMap`` (data: which checkpoint tensor
fills which parameter) and ``load_checkpoint`` applies it to a stream of (name, tensor) pairs,
from safetensors or a GGUF file alike, strictly: a tensor with no slot that is not declared
unused is an error naming it (and the closest names the model has), a parameter the checkpoint
does not fill is an error naming it, and a shape mismatch names both shapes."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cenote.models.weights import copy_weight

if TYPE_CHECKING:
    from cenote.models.layers.quant import QuantizedWeight


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: a parameter, or one row block of a fused one."""

    param: str  # our parameter name
    shard: int | None = None  # row block of a fused parameter (q, k, v -> 0, 1, 2)
    num_shards: int = 1  # equal row blocks of the fused parameter
    rows: tuple[int, int] | None = None  # the block's rows where blocks differ (grouped q/k/v)

    def target(self, param: torch.Tensor) -> torch.Tensor:
        """The part of ``param`` this slot fills (a view)."""
        start, end = self.row_range(param.shape[0])
        return param if (start, end) == (0, param.shape[0]) else param[start:end]

    def row_range(self, num_rows: int) -> tuple[int, int]:
        """First and one-past-last row filled, of a parameter of ``num_rows`` rows."""
        if self.rows is not None:
            return self.rows
        if self.shard is None:
            return 0, num_rows
        size = num_rows // self.num_shards
        return self.shard * size, (self.shard + 1) * size


@dataclass(frozen=True)
class LinearSlot:
    """Where a checkpoint projection lives in a model: a linear module and the block of its
    output rows it fills (a fused q/k/v or gate/up linear holds several). LoRA adapters on that
    projection update exactly these rows (cenote/lora)."""

    module: str  # our linear module's name
    start: int  # first output row
    end: int  # one past the last


@dataclass(frozen=True)
class Derived:
    """A parameter computed from checkpoint tensors rather than copied from one (a classifier
    built from LM-head rows; heads read from side files with ``sources`` empty)."""

    param: str  # our parameter
    sources: tuple[str, ...]  # checkpoint names (without prefix) kept for ``compute``
    compute: Callable[[dict[str, Any]], torch.Tensor]  # the sources found -> the parameter


@dataclass(frozen=True)
class CheckpointMap:
    """Checkpoint name -> slot of one model.

    A name is looked up after stripping the first of ``prefixes`` it starts with (a trunk saved
    inside a task model: ``bert.``, ``distilbert.``) and applying ``renames`` (regex, e.g.
    TensorFlow-era ``LayerNorm.gamma`` -> ``.weight``). ``unused`` are regexes, matched at the
    start of a name, of tensors the model has no use for (an unused pooler, position-id
    buffers); ``optional`` our parameters a checkpoint may lack (they keep their meaning
    without it, e.g. a pooler nobody calls); ``derived`` parameters computed at the end."""

    slots: dict[str, Slot]  # checkpoint name (without prefix, renamed) -> slot
    prefixes: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()  # (pattern, replacement) for ``re.sub``
    optional: frozenset[str] = frozenset()  # our parameters the checkpoint may leave unfilled
    derived: tuple[Derived, ...] = ()

    def key(self, name: str) -> str:
        """A checkpoint name as the slots name it: without its prefix, renamed."""
        for prefix in self.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name

    def slot(self, name: str) -> Slot | None:
        """The slot of checkpoint tensor ``name`` (None: it has none)."""
        return self.slots.get(self.key(name))

    def is_unused(self, key: str) -> bool:
        return any(re.match(pattern, key) for pattern in self.unused)

    def required(self) -> set[str]:
        """The parameters a checkpoint must fill (those of the slots and derivations, but the
        optional ones). Several checkpoint names may fill one: a family's two naming schemes."""
        params = {slot.param for slot in self.slots.values()}
        return (params | {derived.param for derived in self.derived}) - self.optional

    def extended(
        self,
        slots: dict[str, Slot] | None = None,
        unused: tuple[str, ...] = (),
        required: Iterable[str] = (),
        derived: tuple[Derived, ...] = (),
    ) -> CheckpointMap:
        """This map with a head's ``slots``, ``unused`` names and ``derived`` parameters added,
        and the trunk's ``optional`` parameters the head ``required`` (e.g. BERT's pooler)."""
        return replace(
            self,
            slots={**self.slots, **(slots or {})},
            unused=self.unused + unused,
            optional=self.optional - set(required),
            derived=self.derived + derived,
        )

    def load(self, model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``load_checkpoint(model, self, weights)``."""
        return load_checkpoint(model, self, weights)


# TensorFlow-era BERT checkpoints name LayerNorm's weight and bias gamma and beta
TF_LAYER_NORM_NAMES = (
    (r"LayerNorm\.gamma$", "LayerNorm.weight"),
    (r"LayerNorm\.beta$", "LayerNorm.bias"),
)

PlaceQuantized = Callable[[Slot, "QuantizedWeight"], bool]


def load_checkpoint(
    model: nn.Module,
    checkpoint_map: CheckpointMap,
    weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
    place_quantized: PlaceQuantized | None = None,
) -> set[str]:
    """Fill ``model``'s parameters from ``weights`` (Hugging Face names) by ``checkpoint_map``;
    returns the parameters filled (every row block of a fused one; ``required()`` holds them).

    A quantized tensor (GGUF) goes to ``place_quantized``, which returns whether its module
    takes it (the quantized placement is the linear layer's business). Raises ValueError on a
    tensor with no slot that is not declared unused, on a shape mismatch and on a checkpoint
    that leaves a required parameter unfilled, naming the tensors."""
    _check_coverage(model, checkpoint_map)
    params = dict(model.named_parameters())
    kept = {source for derived in checkpoint_map.derived for source in derived.sources}
    sources: dict[str, Any] = {}
    filled: dict[str, set[int | None]] = {}  # parameter -> the row blocks filled (None: whole)
    for name, tensor in weights:
        key = checkpoint_map.key(name)
        if key in kept:
            sources[key] = tensor
        slot = checkpoint_map.slots.get(key)
        if slot is None:
            if key in kept or checkpoint_map.is_unused(key):
                continue
            raise ValueError(_unknown_message(name, key, checkpoint_map, model))
        if not isinstance(tensor, torch.Tensor):
            if place_quantized is None or not place_quantized(slot, tensor):
                raise ValueError(f"quantized tensor {name!r} has no quantized place here")
        else:
            param = params.get(slot.param)
            if param is None:  # a module emptied for quantized tensors, given a dense one
                raise ValueError(f"checkpoint tensor {name!r} has no dense place {slot.param!r}")
            copy_weight(slot.target(param), tensor, name)
        filled.setdefault(slot.param, set()).add(slot.shard)
    num_shards = {
        slot.param: slot.num_shards
        for slot in checkpoint_map.slots.values()
        if slot.shard is not None
    }
    loaded = {
        param
        for param, shards in filled.items()
        if None in shards or shards >= set(range(num_shards[param]))
    }
    for derived in checkpoint_map.derived:
        copy_weight(params[derived.param], derived.compute(sources), derived.param)
        loaded.add(derived.param)
    missing = sorted(checkpoint_map.required() - loaded)
    if missing:
        shown = ", ".join(
            _missing(checkpoint_map, param, filled.get(param, set())) for param in missing[:5]
        )
        raise ValueError(
            f"checkpoint lacks {len(missing)} parameters {type(model).__name__} needs: {shown}"
            + (" ..." if len(missing) > 5 else "")
        )
    return loaded


def _missing(checkpoint_map: CheckpointMap, param: str, shards: set[int | None]) -> str:
    """``param`` and the checkpoint names that would fill what is missing of it."""
    keys = [
        key
        for key, slot in checkpoint_map.slots.items()
        if slot.param == param and (not shards or slot.shard not in shards | {None})
    ]
    return f"{param!r} from " + " or ".join(repr(key) for key in keys)


def linear_slot(model: nn.Module, checkpoint_map: CheckpointMap, name: str) -> LinearSlot | None:
    """The linear module and output rows checkpoint weight ``name`` fills (``LoRATarget``)."""
    slot = checkpoint_map.slot(name)
    if slot is None or not slot.param.endswith(".weight"):
        return None
    module_name = slot.param.removesuffix(".weight")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    num_rows = getattr(module, "out_features", None)
    if not isinstance(num_rows, int):
        return None  # not a linear layer
    start, end = slot.row_range(num_rows)
    return LinearSlot(module_name, start, end)


def _check_coverage(model: nn.Module, checkpoint_map: CheckpointMap) -> None:
    """Every parameter has a slot, a derivation or is optional: none stays uninitialized."""
    covered = {slot.param for slot in checkpoint_map.slots.values()}
    covered |= {derived.param for derived in checkpoint_map.derived} | checkpoint_map.optional
    uncovered = sorted(name for name, _ in model.named_parameters() if name not in covered)
    if uncovered:
        raise AssertionError(
            f"{type(model).__name__}'s checkpoint map fills no slot of {uncovered[:5]}"
        )


def _unknown_message(name: str, key: str, checkpoint_map: CheckpointMap, model: nn.Module) -> str:
    closest = difflib.get_close_matches(key, list(checkpoint_map.slots), n=3, cutoff=0.5)
    hint = f"; closest names it has: {', '.join(closest)}" if closest else ""
    return (
        f"checkpoint tensor {name!r} has no place in {type(model).__name__}{hint}; "
        "does config.json name the right architecture?"
    )


def linear_slots(checkpoint: str, param: str, bias: bool = True) -> dict[str, Slot]:
    """``<checkpoint>.weight`` / ``.bias`` -> ``<param>.weight`` / ``.bias``."""
    kinds = ("weight", "bias") if bias else ("weight",)
    return {f"{checkpoint}.{kind}": Slot(f"{param}.{kind}") for kind in kinds}


def fused_slots(
    checkpoints: list[str],
    param: str,
    rows: list[tuple[int, int]] | None = None,
    bias: bool = True,
) -> dict[str, Slot]:
    """Separate projections (q, k, v) loaded as row blocks of one fused linear ``param``: equal
    blocks, or the given ``rows`` of each (grouped-query attention's smaller k and v)."""
    slots = {}
    for shard, checkpoint in enumerate(checkpoints):
        block = None if rows is None else rows[shard]
        for kind in ("weight", "bias") if bias else ("weight",):
            slots[f"{checkpoint}.{kind}"] = Slot(f"{param}.{kind}", shard, len(checkpoints), block)
    return slots


def same_name_slots(model: nn.Module, skip: Callable[[str], bool]) -> dict[str, Slot]:
    """A slot for each parameter the checkpoint names as we do (those ``skip`` passes over
    are mapped otherwise)."""
    return {name: Slot(name) for name, _ in model.named_parameters() if not skip(name)}
