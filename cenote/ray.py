"""``cenote.ray``, the public name of the Ray Data callables (``import ray, cenote.ray``; see
docs/scaling.md): a re-export of ``cenote.apps.ray``, where they live."""

from cenote.apps.ray import (
    Classifier,
    ClusterUnreachableError,
    Embedder,
    Generator,
    Scorer,
    connect,
)

__all__ = ["Classifier", "ClusterUnreachableError", "Embedder", "Generator", "Scorer", "connect"]
