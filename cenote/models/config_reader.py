"""A model folder, GGUF file or hub id read once into the engine's ``ModelConfig``.

Every entry point (LLM, serve, run-batch, embed, Ray) names its model through
``EngineArgs.create_engine_config()``, which calls ``read_model_config``: the files are found (a
hub id: its cached snapshot), config.json or the GGUF header and the sentence-transformers
metadata are read, and the registry picks the architecture that serves the task.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cenote.config import ModelConfig, PoolerConfig, default_model_path, text_config
from cenote.models.formats.hub_cache import ModelSource, locate_model
from cenote.models.formats.st_config import SentenceTransformerConfig, load_st_config
from cenote.models.registry import (
    VISION_ONLY_ARCHITECTURES,
    ConvertOption,
    bge_m3_architecture,
    convert_architecture,
    pylate_architecture,
)
from cenote.platforms import CpuPlatform, DTypeName, Platform

if TYPE_CHECKING:
    from cenote.models.gguf_loader import GGUFCheckpoint


def read_model_config(
    model: str | os.PathLike[str] | None,
    dtype: DTypeName | torch.dtype = "auto",
    max_model_len: int | None = None,
    hf_overrides: dict[str, Any] | None = None,
    served_model_name: str | None = None,
    pooler_config: PoolerConfig | dict[str, Any] | None = None,
    convert: ConvertOption = "auto",
    max_logprobs: int = 20,
    revision: str | None = None,
    platform: Platform | None = None,
) -> ModelConfig:
    """Read a model folder, GGUF file or hub id (``owner/name`` from the local Hugging Face
    cache at ``revision``) once; ``convert`` swaps the architecture for the sibling that
    serves the task (a causal LM becomes a sequence classifier). ``platform`` (the engine
    config's; None: this machine's CPU) resolves ``dtype='auto'`` and places the model."""
    platform = platform or CpuPlatform()
    # every entry point (LLM, serve, run-batch, embed, Ray) names its model here
    source = _model_source(model, revision)
    path = source.path
    gguf = _open_gguf(path)
    hf_config = {**_read_hf_config(path, gguf), **(hf_overrides or {})}
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ValueError(f"{path / 'config.json'} names no architecture")
    architecture = pylate_architecture(path, bge_m3_architecture(path, architectures[0]))
    converted = convert_architecture(architecture, convert)
    if converted != architectures[0]:  # kept in the config: what every reader sees
        hf_config["architectures"] = [converted]
    st_config = gguf.st_config if gguf is not None else load_st_config(path)
    limit = _model_len_limit(hf_config, st_config)
    if max_model_len is not None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
        limit = max_model_len
    return ModelConfig(
        path=path,
        architecture=converted,
        hf_config=hf_config,
        dtype=platform.resolve_dtype(dtype),
        max_model_len=limit,
        st_config=st_config,
        served_model_name=served_model_name or source.name,
        pooler_config=PoolerConfig.of(pooler_config),
        max_logprobs=max_logprobs,
        gguf=gguf,
        device=platform.device_type,
        vision_only=converted in VISION_ONLY_ARCHITECTURES,
    )


def _model_source(model: str | os.PathLike[str] | None, revision: str | None) -> ModelSource:
    if model is not None:
        return locate_model(model, revision)
    if revision is not None:
        raise ValueError(f"revision {revision!r} needs a hub id; no model was given")
    return ModelSource(path=default_model_path(), name="sentence-transformers/all-MiniLM-L6-v2")


def _open_gguf(path: Path) -> GGUFCheckpoint | None:
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    from cenote.models.gguf_loader import load_gguf

    return load_gguf(path)


def _read_hf_config(path: Path, gguf: GGUFCheckpoint | None) -> dict[str, Any]:
    if gguf is not None:
        return dict(gguf.config)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is not a model folder (config.json is missing) nor a .gguf file"
        )
    with open(path / "config.json", encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    return config


def _model_len_limit(hf_config: dict[str, Any], st_config: SentenceTransformerConfig | None) -> int:
    limit = int(text_config(hf_config).get("max_position_embeddings", 2048))
    if hf_config.get("model_type") in ("roberta", "xlm-roberta", "camembert", "mpnet"):
        limit -= int(hf_config.get("pad_token_id", 1)) + 1  # positions start after padding_idx
    if st_config is not None and st_config.max_seq_length:
        limit = min(limit, int(st_config.max_seq_length))
    return limit
