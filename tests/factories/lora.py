"""PEFT LoRA adapters written by ``peft`` itself over the tiny bases, and the references they
give: peft's merged model (the adapter folded into the base weights)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def write_adapter(
    base: torch.nn.Module, folder: Path, seed: int, targets: list[str], **lora_options
) -> torch.nn.Module:
    """Save a random LoRA adapter of ``base`` (``init_lora_weights=False``: B is not zero, so
    the adapter changes the output) to ``folder``; returns peft's merged model (fp32, eval)."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(target_modules=targets, init_lora_weights=False, **lora_options)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # peft's random B is small; scale it so the adapter moves tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


def write_head_adapter(
    base: torch.nn.Module,
    folder: Path,
    seed: int,
    targets: list[str],
    modules_to_save: list[str],
    **lora_options,
) -> torch.nn.Module:
    """Save a random LoRA adapter of ``base`` that also saves full copies of
    ``modules_to_save`` (a classifier head), those copies re-drawn at random so that they differ
    from the base's; returns the adapter as ``peft.PeftModel.from_pretrained`` loads it back
    over a fresh copy of ``base`` (the reference: fp32, eval)."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(
        target_modules=targets,
        modules_to_save=modules_to_save,
        init_lora_weights=False,
        **lora_options,
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
            elif ".modules_to_save." in name:
                param.copy_(torch.randn_like(param) * 0.5)
    model.save_pretrained(folder)
    return peft.PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()
