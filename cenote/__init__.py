"""cenote: one inference engine for generation and pooling."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "PoolingParams",
    "SamplingParams",
    "RequestOutput",
    "PoolingRequestOutput",
    "ClassificationOutput",
    "EmbeddingOutput",
    "PoolingOutput",
    "ScoringOutput",
    "__version__",
]

if TYPE_CHECKING:
    from cenote.entrypoints.llm import LLM
    from cenote.outputs import (
        ClassificationOutput,
        EmbeddingOutput,
        PoolingOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringOutput,
    )
    from cenote.pooling_params import PoolingParams
    from cenote.sampling_params import SamplingParams

_LAZY = {
    "LLM": "cenote.entrypoints.llm",
    "PoolingParams": "cenote.pooling_params",
    "SamplingParams": "cenote.sampling_params",
    "RequestOutput": "cenote.outputs",
    "PoolingRequestOutput": "cenote.outputs",
    "PoolingOutput": "cenote.outputs",
    "ScoringOutput": "cenote.outputs",
    "EmbeddingOutput": "cenote.outputs",
    "ClassificationOutput": "cenote.outputs",
}


def __getattr__(name: str) -> object:
    """Import lazily: nothing heavy runs at ``import cenote``."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cenote' has no attribute {name!r}")
