"""sentence-transformers metadata of a model folder, read as data (nothing is executed)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PoolingMethodName = Literal["cls", "mean", "last", "all", "step"]

_SUPPORTED_POOLING_MODES: dict[str, PoolingMethodName] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
_NEW_POOLING_MODES = {  # sentence-transformers >= 6: ``"pooling_mode": "mean"``
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": None,
}


@dataclass(frozen=True)
class DenseLayer:
    """One sentence-transformers Dense module: ``activation(x @ W.T + b)``."""

    path: Path  # folder with the weights (model.safetensors or pytorch_model.bin)
    in_features: int
    out_features: int
    bias: bool
    activation: str | None  # "tanh" or None (identity)


@dataclass(frozen=True)
class SparsePoolingConfig:
    """sentence-transformers SpladePooling: ``strategy`` (max or sum) over the tokens of
    ``log1p(relu(mlm_logits))`` (``log1p_relu``: log1p applied twice)."""

    strategy: Literal["max", "sum"]
    activation: Literal["relu", "log1p_relu"]


@dataclass(frozen=True)
class SentenceTransformerConfig:
    """What sentence-transformers would do around the transformer trunk."""

    pooling: PoolingMethodName | None = None  # from 1_Pooling/config.json
    normalize: bool = False  # a Normalize module is present
    dense_layers: tuple[DenseLayer, ...] = ()  # Dense projectors, in order
    max_seq_length: int | None = None  # sentence_bert_config.json
    do_lower_case: bool = False  # sentence_bert_config.json
    prompts: dict[str, str] = field(default_factory=dict)  # config_sentence_transformers.json
    default_prompt_name: str | None = None
    similarity_fn_name: str | None = None
    sparse_pooling: SparsePoolingConfig | None = None  # SparseEncoder: 1_SpladePooling/config.json
    include_prompt: bool = True  # Pooling: false leaves the instruction prompt out of CLS / MEAN


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _pooling_method(config: dict[str, Any], where: Path) -> PoolingMethodName:
    """Legacy ``pooling_mode_<x>: true`` flags, or (sentence-transformers >= 6) one
    ``pooling_mode`` entry naming the mode (a string, or a list of them)."""
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        names = [mode] if isinstance(mode, str) else list(mode)
        enabled = [_NEW_POOLING_MODES.get(name, name) for name in names]
    else:
        enabled = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
    if len(enabled) != 1 or enabled[0] not in _SUPPORTED_POOLING_MODES:
        raise ValueError(
            f"{where}: unsupported sentence-transformers pooling {enabled or 'none'}; "
            f"cenote supports exactly one of {sorted(_SUPPORTED_POOLING_MODES)}"
        )
    return _SUPPORTED_POOLING_MODES[enabled[0]]


def _max_seq_length(model_dir: Path, bert_config: dict[str, Any]) -> int | None:
    """sentence_bert_config.json's ``max_seq_length``, else (as sentence-transformers does, and
    where version 6 saves it) the tokenizer's ``model_max_length``."""
    if bert_config.get("max_seq_length"):
        return int(bert_config["max_seq_length"])
    path = model_dir / "tokenizer_config.json"
    if path.exists():
        length = _read_json(path).get("model_max_length")
        if isinstance(length, int) and 0 < length < 1_000_000:  # absent = a huge sentinel
            return length
    return None


def _dense_layer(folder: Path) -> DenseLayer:
    config = _read_json(folder / "config.json")
    name = config.get("activation_function", "torch.nn.modules.linear.Identity")
    if name not in _ACTIVATIONS:
        raise ValueError(f"{folder}: unsupported Dense activation {name!r}")
    return DenseLayer(
        path=folder,
        in_features=int(config["in_features"]),
        out_features=int(config["out_features"]),
        bias=bool(config.get("bias", True)),
        activation=_ACTIVATIONS[name],
    )


def _splade_pooling(config: dict[str, Any], where: Path) -> SparsePoolingConfig:
    strategy = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    if strategy not in ("max", "sum") or activation not in ("relu", "log1p_relu"):
        raise ValueError(
            f"{where}: unsupported SpladePooling (pooling_strategy {strategy!r}, "
            f"activation_function {activation!r}); cenote supports max or sum over relu or "
            "log1p_relu"
        )
    return SparsePoolingConfig(strategy, activation)


def is_pylate_folder(model_dir: Path) -> bool:
    """A sentence-transformers folder PyLate saved for ColBERT: its
    config_sentence_transformers.json carries PyLate's ``query_prefix`` / ``document_prefix``
    or ``model_type: ColBERT`` (what sentence-transformers' ``MultiVectorEncoder`` reads)."""
    path = model_dir / "config_sentence_transformers.json"
    if not (model_dir / "modules.json").exists() or not path.exists():
        return False
    config = _read_json(path)
    return config.get("model_type") == "ColBERT" or "query_prefix" in config


def load_st_config(model_dir: Path) -> SentenceTransformerConfig | None:
    """Parse modules.json and friends; None when the folder is not a sentence-transformers model."""
    modules_path = model_dir / "modules.json"
    if not modules_path.exists():
        return None
    pooling, normalize, dense, sparse, include_prompt = None, False, [], None, True
    for module in _read_json(modules_path):
        kind = module["type"].rsplit(".", 1)[-1]
        folder = model_dir / module.get("path", "")
        if kind == "Pooling":
            pooling_config = _read_json(folder / "config.json")
            pooling = _pooling_method(pooling_config, folder)
            include_prompt = bool(pooling_config.get("include_prompt", True))
        elif kind == "Normalize":
            normalize = True
        elif kind == "Dense":
            dense.append(_dense_layer(folder))
        elif kind == "SpladePooling":
            sparse = _splade_pooling(_read_json(folder / "config.json"), folder)
        elif kind not in ("Transformer", "MLMTransformer"):
            raise ValueError(f"{modules_path}: unsupported sentence-transformers module {kind!r}")
    bert_config = {}
    if (model_dir / "sentence_bert_config.json").exists():
        bert_config = _read_json(model_dir / "sentence_bert_config.json")
    st_config = {}
    if (model_dir / "config_sentence_transformers.json").exists():
        st_config = _read_json(model_dir / "config_sentence_transformers.json")
    return SentenceTransformerConfig(
        pooling=pooling,
        # PyLate normalizes token vectors without listing a Normalize module
        normalize=normalize or is_pylate_folder(model_dir),
        dense_layers=tuple(dense),
        max_seq_length=_max_seq_length(model_dir, bert_config),
        do_lower_case=bool(bert_config.get("do_lower_case", False)),
        prompts=dict(st_config.get("prompts") or {}),
        default_prompt_name=st_config.get("default_prompt_name"),
        similarity_fn_name=st_config.get("similarity_fn_name"),
        sparse_pooling=sparse,
        include_prompt=include_prompt,
    )
