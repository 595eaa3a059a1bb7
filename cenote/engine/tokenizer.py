"""Load a model's fast tokenizer (the `tokenizers` library) with padding and truncation off."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(model_dir: Path) -> Tokenizer:
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{model_dir} has no tokenizer.json; cenote uses the fast tokenizer format only"
        )
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def load_tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
