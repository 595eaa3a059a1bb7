"""An adapter's ``modules_to_save``: its own copy of the model's classification head.

PEFT trains a full copy of modules such as ``classifier`` (BERT's linear; RoBERTa's and
XLM-R's dense -> tanh -> out_proj, both linears saved) or ``score`` (Llama / Qwen sequence
classifiers) beside the LoRA factors and saves their tensors under the base
checkpoint's names. Here they are checked against the model's head (``ReplaceableHead``:
only the linear layers ``compute_scores`` reads may be replaced, shapes equal to the base's)
and turned into a score function: the model's own ``compute_scores`` run with those parameters
swapped in (``torch.func.functional_call``), for that adapter's requests only; the base head
serves every other request of the step. An LM head copy (``lm_head`` of a causal LM) would need
per-row vocabulary projections and sampling and is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from cenote.models.interfaces import LoRATarget, ReplaceableHead, SequenceScorer
from cenote.pooling.metadata import ScoreFn


class _HeadCall(nn.Module):
    """``model.compute_scores`` as a module's forward, for ``functional_call``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.model, SequenceScorer)  # checked by ``head_tensors``
        return self.model.compute_scores(hidden)


def head_tensors(
    model: object, path: Path, saved: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """The adapter's ``saved`` tensors (checkpoint name -> tensor) as our head parameter names
    -> tensors on ``device`` (fp32: heads run in fp32); ValueError naming what cannot replace
    the head (an LM head, a trunk module, another base's shapes)."""
    if not saved:
        return {}
    modules = sorted({name.rpartition(".")[0] for name in saved})
    if not isinstance(model, ReplaceableHead) or not isinstance(model, SequenceScorer):
        what = "an LM head copy is not supported; " if "lm_head" in modules else ""
        raise ValueError(
            f"LoRA adapter {path} saves full modules {modules} (modules_to_save): {what}"
            f"{type(model).__name__} has no classification head an adapter may replace "
            "(sequence and token classifiers do)"
        )
    # every ReplaceableHead is a module that maps checkpoint names
    assert isinstance(model, LoRATarget) and isinstance(model, nn.Module)
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in saved.items():
        module, _, leaf = name.rpartition(".")
        slot = model.linear_slot(f"{module}.weight")
        if slot is None or slot.module not in model.head_modules:
            raise ValueError(
                f"LoRA adapter {path} saves {module!r} (modules_to_save), which is not part of "
                f"{type(model).__name__}'s classification head (its linear layers "
                f"{', '.join(model.head_modules)}); only the head may be replaced per request"
            )
        ours = f"{slot.module}.{leaf}"
        base = params.get(ours)
        if base is None or base.shape != tensor.shape:
            expected = "none" if base is None else tuple(base.shape)
            raise ValueError(
                f"LoRA adapter {path} does not fit this base model: its saved {name} is "
                f"{tuple(tensor.shape)}, the base head's is {expected}; is it an adapter for "
                "another base model (or another number of labels)?"
            )
        tensors[ours] = tensor.to(device, torch.float32)
    return tensors


def head_score(model: object, tensors: dict[str, torch.Tensor]) -> ScoreFn:
    """``model.compute_scores`` with the head parameters ``tensors`` (ours -> tensor) in place
    of the model's, leaving the model itself untouched."""
    assert isinstance(model, nn.Module)
    call = _HeadCall(model)
    replaced = {f"model.{name}": tensor for name, tensor in tensors.items()}

    def score(hidden: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = torch.func.functional_call(
            call, replaced, (hidden,), tie_weights=False, strict=False
        )
        return result

    return score
