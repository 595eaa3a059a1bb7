"""Load a model's fast tokenizer (the `tokenizers` library) with padding and truncation off."""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer, models

from cenote.config import ModelConfig
from cenote.models.registry import VISION_ONLY_ARCHITECTURES


def load_tokenizer(model_config: ModelConfig) -> Tokenizer:
    """tokenizer.json of a folder, or the tokenizer in a GGUF file's metadata (a vision-only
    folder without one: an empty tokenizer)."""
    if model_config.gguf is not None:  # the file opened once, by the config
        tokenizer = model_config.gguf.tokenizer
    else:
        path = model_config.path / "tokenizer.json"
        if not path.exists() and model_config.architecture in VISION_ONLY_ARCHITECTURES:
            return _empty_tokenizer()
        if not path.exists():
            raise FileNotFoundError(
                f"{model_config.path} has no tokenizer.json; cenote reads the fast tokenizer "
                "format only"
            )
        tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _empty_tokenizer() -> Tokenizer:
    """A tokenizer of one unknown token, for a vision-only folder (its requests are images;
    texts are refused before they are tokenized)."""
    return Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))


def load_tokenizer_config(model_config: ModelConfig) -> dict[str, Any]:
    if model_config.gguf_file is not None:
        return {}
    path = model_config.path / "tokenizer_config.json"
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    return config


def load_chat_template(model_config: ModelConfig) -> str | None:
    """The model's chat template: GGUF metadata, tokenizer_config.json or chat_template.jinja."""
    if model_config.gguf is not None:
        return model_config.gguf.chat_template
    template = load_tokenizer_config(model_config).get("chat_template")
    jinja = model_config.path / "chat_template.jinja"
    if template is None and jinja.exists():
        template = jinja.read_text(encoding="utf-8")
    return template
