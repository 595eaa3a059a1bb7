"""sentence-transformers folders: metadata written by hand over a saved trunk, or models saved
by sentence-transformers itself (SentenceTransformer, CrossEncoder, SparseEncoder)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

ST_POOLING_MODES = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "last": "pooling_mode_lasttoken",
}


def _module(idx: int, path: str, kind: str) -> dict:
    return {
        "idx": idx,
        "name": str(idx),
        "path": path,
        "type": f"sentence_transformers.models.{kind}",
    }


def with_st_pooling(source: Path, target: Path, method: str, normalize: bool = False) -> Path:
    """A copy of model folder ``source`` with sentence-transformers metadata selecting ``method``
    (``modules.json`` + ``1_Pooling/config.json``, plus a Normalize module if asked)."""
    shutil.copytree(source, target)
    modules = [_module(0, "", "Transformer"), _module(1, "1_Pooling", "Pooling")]
    if normalize:
        modules.append(_module(2, "2_Normalize", "Normalize"))
    (target / "modules.json").write_text(json.dumps(modules))
    hidden = json.loads((source / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden}
    pooling.update({mode: name == method for name, mode in ST_POOLING_MODES.items()})
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return target


def save_sentence_transformer(
    trunk: Path,
    target: Path,
    pooling: str = "mean",
    normalize: bool = True,
    dense: Sequence[tuple[int, int, bool]] = (),
    seed: int = 0,
    max_seq_length: int | None = None,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    **pooling_kwargs,
) -> Path:
    """``trunk`` (a saved transformers model) -> Pooling(``pooling``) -> Dense(in, out, bias)
    ... [-> Normalize], saved by sentence-transformers itself into ``target``. Dense weights are
    seeded ``N(0, 1 / in)``, biases ``N(0, 1)``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    transformer = Transformer(str(trunk), max_seq_length=max_seq_length)
    modules = [
        transformer,
        Pooling(transformer.get_embedding_dimension(), pooling, **pooling_kwargs),
    ]
    torch.manual_seed(seed)
    for in_features, out_features, bias in dense:
        layer = Dense(in_features, out_features, bias=bias, activation_function=torch.nn.Identity())
        with torch.no_grad():
            layer.linear.weight.normal_(0, in_features**-0.5)
            if bias:
                layer.linear.bias.normal_()
        modules.append(layer)
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(
        modules=modules, device="cpu", prompts=prompts, default_prompt_name=default_prompt_name
    )
    model.save(str(target))
    return target


def save_cross_encoder(raw: Path, target: Path) -> Path:
    """A transformers sequence classifier re-saved by sentence-transformers' CrossEncoder."""
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(raw), device="cpu").save(str(target))
    return target


def save_sparse_encoder(
    raw: Path, target: Path, strategy: str = "max", activation: str = "relu"
) -> Path:
    """A transformers masked LM -> SpladePooling(``strategy``, ``activation``), saved by
    sentence-transformers' SparseEncoder (a SPLADE folder)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    transformer = Transformer(str(raw), transformer_task="fill-mask")
    pooling = SpladePooling(strategy, activation_function=activation)
    SparseEncoder(modules=[transformer, pooling], device="cpu").save(str(target))
    return target
