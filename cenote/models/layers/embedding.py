"""Embedding tables that are not randomly initialized: their weights always come from the
checkpoint. ``nn.Embedding`` draws its table with ``normal_``, and on the meta device (where
cenote builds every model before loading it) that call goes through torch's reference
implementation, which imports ``torch._dynamo``: over a second of every engine start
(docs/performance.md), for values that are thrown away."""

from __future__ import annotations

from torch import nn


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table is left as allocated (empty until the weights load)."""

    def reset_parameters(self) -> None:
        """Nothing to draw: ``load_weights`` fills the table."""
