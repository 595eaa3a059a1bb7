"""The one loading mechanism (cenote/models/checkpoint_map.py): strict by a declared map, and
folders saved by transformers load with nothing unknown."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from cenote.config import ModelConfig
from cenote.models.checkpoint_map import (
    TF_LAYER_NORM_NAMES,
    CheckpointMap,
    Derived,
    LinearSlot,
    Slot,
    fused_slots,
    linear_slot,
    linear_slots,
    load_checkpoint,
)
from cenote.models.config_reader import read_model_config
from cenote.models.loader import iterate_weights, load_model
from tests.factories.decoders import make_decoder, make_pooling_decoder
from tests.factories.encoders import make_encoder_classifier, make_model


class _Tiny(nn.Module):
    """A fused q/k/v projection (k and v half the size of q), a norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 8 + 4 + 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2, bias=False)


_ROWS = [(0, 8), (8, 12), (12, 16)]
_MAP = CheckpointMap(
    {
        **fused_slots(["attn.q", "attn.k", "attn.v"], "qkv", _ROWS),
        **linear_slots("LayerNorm", "norm"),
        "head.weight": Slot("head.weight"),
    },
    prefixes=("tiny.",),
    unused=(r"embeddings\.position_ids", r".*inv_freq$"),
    renames=TF_LAYER_NORM_NAMES,
)


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "tiny.attn.q.weight": (8, 4),
        "tiny.attn.q.bias": (8,),
        "tiny.attn.k.weight": (4, 4),
        "tiny.attn.k.bias": (4,),
        "tiny.attn.v.weight": (4, 4),
        "tiny.attn.v.bias": (4,),
        "tiny.LayerNorm.weight": (4,),
        "tiny.LayerNorm.bias": (4,),
        "head.weight": (2, 4),
    }
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def test_fused_shards_equal_a_manual_cat() -> None:
    model, weights = _Tiny(), _checkpoint()
    loaded = load_checkpoint(model, _MAP, weights.items())
    assert loaded == _MAP.required()
    for kind in ("weight", "bias"):
        expected = torch.cat([weights[f"tiny.attn.{p}.{kind}"] for p in ("q", "k", "v")])
        assert torch.equal(getattr(model.qkv, kind), expected)
    assert torch.equal(model.norm.weight, weights["tiny.LayerNorm.weight"])
    assert linear_slot(model, _MAP, "tiny.attn.k.weight") == LinearSlot("qkv", 8, 12)  # LoRA


def test_unknown_tensor_is_refused_naming_it_and_the_closest_names() -> None:
    weights = {**_checkpoint(), "tiny.attn.qq.weight": torch.zeros(8, 4)}
    with pytest.raises(ValueError, match=r"'tiny\.attn\.qq\.weight' has no place.*attn\.q\.weight"):
        load_checkpoint(_Tiny(), _MAP, weights.items())


def test_declared_unused_tensors_are_accepted() -> None:
    weights = {
        **_checkpoint(),
        "tiny.embeddings.position_ids": torch.arange(4),
        "tiny.rotary.inv_freq": torch.ones(2),
    }
    load_checkpoint(_Tiny(), _MAP, weights.items())


def test_renamed_tensors_load() -> None:
    weights = _checkpoint()
    weights["tiny.LayerNorm.gamma"] = weights.pop("tiny.LayerNorm.weight")
    weights["tiny.LayerNorm.beta"] = weights.pop("tiny.LayerNorm.bias")
    model = _Tiny()
    load_checkpoint(model, _MAP, weights.items())
    assert torch.equal(model.norm.bias, weights["tiny.LayerNorm.beta"])


def test_missing_tensor_is_named_with_its_parameter() -> None:
    weights = _checkpoint()
    del weights["tiny.attn.v.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 parameters.*'qkv\.bias' from 'attn\.v\.bias'"):
        load_checkpoint(_Tiny(), _MAP, weights.items())


def test_shape_mismatch_names_both_shapes() -> None:
    weights = {**_checkpoint(), "tiny.attn.k.weight": torch.zeros(5, 4)}
    with pytest.raises(ValueError, match=r"'tiny\.attn\.k\.weight' has shape \(5, 4\).*\(4, 4\)"):
        load_checkpoint(_Tiny(), _MAP, weights.items())


def test_derived_parameter_is_computed_from_kept_tensors() -> None:
    """A head built from checkpoint rows that have no slot of their own (classifier_from_token)."""
    rows = Derived("head.weight", ("lm_head.weight",), lambda found: found["lm_head.weight"][:2])
    slots = {key: slot for key, slot in _MAP.slots.items() if key != "head.weight"}
    checkpoint_map = CheckpointMap(slots, prefixes=("tiny.",), derived=(rows,))
    weights = _checkpoint()
    del weights["head.weight"]
    lm_head = torch.randn(6, 4)
    model = _Tiny()
    load_checkpoint(model, checkpoint_map, [*weights.items(), ("lm_head.weight", lm_head)])
    assert torch.equal(model.head.weight, lm_head[:2])


def test_a_parameter_no_slot_fills_is_a_map_error() -> None:
    slots = {key: slot for key, slot in _MAP.slots.items() if key != "head.weight"}
    with pytest.raises(AssertionError, match=r"fills no slot of \['head\.weight'\]"):
        load_checkpoint(_Tiny(), CheckpointMap(slots, prefixes=("tiny.",)), [])


# ---- folders saved by transformers: every tensor has a slot or is declared unused -----------


def _saved(kind: str, folder: Path) -> None:
    if kind == "bert":
        make_model(folder, "bert")
    elif kind == "bert-classifier":
        make_model(folder, "bert", "ForSequenceClassification")
    elif kind == "roberta-classifier":
        make_encoder_classifier(folder, "roberta", "ForSequenceClassification")
    elif kind == "distilbert-masked-lm":
        make_model(folder, "distilbert", "ForMaskedLM")
    elif kind == "llama":
        make_decoder(folder, "llama")
    elif kind == "qwen2-classifier":
        make_pooling_decoder(folder, "qwen2", "ForSequenceClassification")


@pytest.mark.parametrize(
    "kind",
    [
        "bert",
        "bert-classifier",
        "roberta-classifier",
        "distilbert-masked-lm",
        "llama",
        "qwen2-classifier",
    ],
)
def test_transformers_folders_load_strictly(kind: str, tmp_path: Path) -> None:
    _saved(kind, tmp_path)
    model_config: ModelConfig = read_model_config(str(tmp_path), dtype="float32")
    model = load_model(model_config)  # raises on any unknown or missing tensor
    checkpoint_map = model.checkpoint_map
    names = [name for name, _ in iterate_weights(tmp_path)]
    unused = [
        name
        for name in names
        if checkpoint_map.slot(name) is None and checkpoint_map.is_unused(checkpoint_map.key(name))
    ]
    # only buffers and tied copies are passed over, never a weight the model reads
    assert all(
        name.endswith(("position_ids", "decoder.weight", "decoder.bias")) for name in unused
    ), unused
