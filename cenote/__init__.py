"""cenote: one inference engine for generation and pooling.

The package exports the offline API, ``cenote.llm``'s ``__all__`` (``LLM``, its
params and output classes), imported on first use: nothing heavy runs at ``import cenote``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from cenote.llm import *  # noqa: F403

_API = "cenote.llm"


def __getattr__(name: str) -> object:
    """The offline API's names, imported lazily."""
    if not name.startswith("__"):
        api = importlib.import_module(_API)
        if name in api.__all__:
            return getattr(api, name)
    raise AttributeError(f"module 'cenote' has no attribute {name!r}")
