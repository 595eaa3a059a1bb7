"""Which models ``cenote serve`` serves, and with which options.

- ``cenote serve PATH`` or ``--model PATH``: one model, named by ``--served-model-name`` or its
  folder / file (unchanged);
- ``--model NAME=PATH`` (repeatable): each model served as NAME;
- ``--models-dir DIR`` alone: no model is loaded at start (``models_dir_entries``: each
  model of DIR loads on its first request);
- ``--config FILE``: a JSON object ``{"models": {"NAME": {"model": PATH, OPTION: VALUE...}}}``
  whose OPTIONs are the engine options (``dtype``, ``max_model_len``,
  ``max_num_batched_tokens``, ``kv_cache_memory_bytes`` (bytes, or "4GiB"), ``quantization``,
  ``num_threads``... every ``EngineArgs`` field) plus ``data_parallel_size`` and
  ``chat_template``.

The command line's engine flags are every model's defaults; a config file's options override
them for its model. Models are served in the order given (positional, ``--model``s, then the
config file's); the first is the default of requests that name none.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cenote.engine_args import EngineArgs

# options a config file sets per model beyond EngineArgs' fields (the server's, per model)
_SERVER_OPTIONS = ("data_parallel_size", "chat_template")


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve."""

    name: str | None  # the served name; None: --served-model-name, else the folder's / file's
    engine_args: EngineArgs
    options: dict[str, Any]  # server options of this model (data_parallel_size, chat_template)


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """The models of a ``cenote serve`` command line (``args.models``: the ``--model`` flags,
    ``args.config``: the config file), with their engine args built on the command line's."""
    base = EngineArgs.from_cli_args(args)
    flags = [_split(value) for value in args.models or []]
    unnamed = [str(base.model)] if base.model is not None else []
    unnamed += [path for name, path in flags if name is None]
    if len(unnamed) > 1:
        raise ValueError(
            f"{len(unnamed)} models have no name ({', '.join(unnamed)}): give each served model "
            "a name with --model NAME=PATH"
        )
    if unnamed:  # a bare --model PATH is the positional MODEL
        base = dataclasses.replace(base, model=unnamed[0])
    named = [(name, path) for name, path in flags if name is not None]
    from_file = _read_config(args.config) if args.config else {}
    if not named and not from_file:  # the single-model server, as before
        if base.model is None and getattr(args, "models_dir", None):
            return []  # only the models of --models-dir, loaded on demand
        return [ModelSpec(None, base, {})]
    if base.served_model_name is not None:
        raise ValueError(
            "--served-model-name names one model; with several, name each: --model NAME=PATH"
        )
    specs = [ModelSpec(None, base, {})] if unnamed else []
    for name, path in named:
        engine_args = dataclasses.replace(base, model=path, served_model_name=name)
        specs.append(ModelSpec(name, engine_args, {}))
    for name, options in from_file.items():
        specs.append(_spec_from_file(name, options, base))
    _check_unique([spec.name for spec in specs if spec.name is not None])
    return specs


def _split(value: str) -> tuple[str | None, str]:
    """``NAME=PATH`` -> (NAME, PATH); a bare ``PATH`` -> (None, PATH)."""
    name, sep, path = value.partition("=")
    if not sep:
        return None, value
    if not name or not path:
        raise ValueError(f"--model {value!r}: expected NAME=PATH (or a bare PATH)")
    return name, path


def _read_config(path: str) -> dict[str, dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as file:
            value = json.load(file)
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}: not JSON: {e}") from e
    models = value.get("models") if isinstance(value, dict) else None
    if not isinstance(models, dict) or not models or set(value) != {"models"}:
        raise ValueError(
            f'--config {path}: expected {{"models": {{"NAME": {{"model": PATH, ...}}}}}} with '
            "at least one model and no other key"
        )
    for name, options in models.items():
        if not isinstance(options, dict) or not isinstance(options.get("model"), str):
            raise ValueError(
                f"--config {path}: model {name!r} must be an object with a 'model' path"
            )
    base = Path(path).parent
    return {name: {**o, "model": _relative_to(base, o["model"])} for name, o in models.items()}


def _relative_to(folder: Path, model: str) -> str:
    """A relative model path is read from the config file's folder when it exists there."""
    candidate = folder / model
    return str(candidate) if not Path(model).is_absolute() and candidate.exists() else model


def _spec_from_file(name: str, options: dict[str, Any], base: EngineArgs) -> ModelSpec:
    engine_fields = {f.name: f for f in fields(EngineArgs)}
    valid = sorted([*(n for n in engine_fields if n != "served_model_name"), *_SERVER_OPTIONS])
    engine_options: dict[str, Any] = {}
    server_options: dict[str, Any] = {}
    for key, value in options.items():
        if key in _SERVER_OPTIONS:
            server_options[key] = value
        elif key in engine_fields and key != "served_model_name":
            parse = engine_fields[key].metadata.get("parse")
            if parse is not None and isinstance(value, str):  # e.g. "4GiB"
                try:
                    value = parse(value)
                except argparse.ArgumentTypeError as e:
                    raise ValueError(f"--config: model {name!r}, {key}: {e}") from None
            engine_options[key] = value
        else:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"--config: model {name!r} has an unknown option {key!r}{hint}; valid options: "
                f"{', '.join(valid)}"
            )
    size = server_options.get("data_parallel_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"--config: model {name!r}, data_parallel_size must be a positive integer, got {size!r}"
        )
    template = server_options.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"--config: model {name!r}, chat_template must be a string")
    try:
        engine_args = dataclasses.replace(base, **engine_options, served_model_name=name)
    except TypeError as e:  # EngineArgs checks each value's type
        raise ValueError(f"--config: model {name!r}: {e}") from None
    return ModelSpec(name, engine_args, server_options)


def models_dir_entries(folder: str) -> list[tuple[str, str]]:
    """The models of ``--models-dir``: (name, path) of each folder directly under ``folder``
    that has a ``config.json`` (a transformers / sentence-transformers folder), named by the
    folder, and of each ``.gguf`` file there, named by the file without ``.gguf``; sorted."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--models-dir {folder}: not a folder")
    entries = []
    for path in sorted(root.iterdir()):
        if path.is_dir() and (path / "config.json").is_file():
            entries.append((path.name, str(path)))
        elif path.is_file() and path.suffix == ".gguf":
            entries.append((path.stem, str(path)))
    if not entries:
        raise ValueError(
            f"--models-dir {folder}: no model in it (a folder with a config.json, or a .gguf "
            "file, directly under it)"
        )
    names = [name for name, _ in entries]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:  # a folder and a .gguf file of the same name
        raise ValueError(f"--models-dir {folder}: two models are named {repeated}; rename one")
    return entries


def _check_unique(names: list[str]) -> None:
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"models named more than once: {repeated}; give each its own name")
