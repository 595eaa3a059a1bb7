"""The language-model head of the decoders: last hidden states -> fp32 logits over the vocabulary.

Its weight is the model's own ``lm_head`` or the embedding table (tied); the checkpoint names stay
the model's, so this head holds no parameters: it is handed the module holding the weight. A
quantized head it builds is its submodule, so the model's passes over its ``QuantLinear``s (dense
copies, bf16 dot products) reach it. After
``prepare`` (the model's ``post_load``, weights final) it multiplies on a oneDNN-prepacked copy in
the runtime dtype (the costliest matmul of a decode step; docs/performance.md), or, where the
weight came quantized, on the quantized bytes (a tied quantized table multiplies as a
``QuantLinear`` over the same bytes). An optional soft-cap bounds the logits:
``tanh(logits / cap) * cap`` (Gemma).
"""

from __future__ import annotations

import torch
from torch import nn

from cenote.models.layers.linear import pack_weight, packed_linear
from cenote.models.layers.quant import QuantEmbedding, QuantLinear


class LMHead(nn.Module):
    """``head(hidden [N, hidden], weight_module) -> fp32 logits [N, vocab]`` (the matmul in the
    model's dtype); ``weight_module`` is an ``nn.Linear`` / ``nn.Embedding`` (dense or
    quantized) whose rows are the vocabulary."""

    def __init__(self, softcap: float | None = None) -> None:
        super().__init__()
        self.softcap = softcap
        self._quantized: QuantLinear | None = None  # set by prepare, where the weight is
        self._packed: torch.Tensor | None = None  # set by prepare, where oneDNN packs it

    def prepare(self, weight_module: nn.Module) -> None:
        """Once the weights are loaded and cast: keep quantized weights quantized, else prepack
        the dense one."""
        self._quantized, self._packed = None, None
        if isinstance(weight_module, QuantEmbedding):
            self._quantized = QuantLinear([weight_module.weight_q], None)
        elif isinstance(weight_module, QuantLinear):
            self._quantized = weight_module
        else:
            self._packed = pack_weight(_dense_weight(weight_module))

    def forward(self, hidden: torch.Tensor, weight_module: nn.Module) -> torch.Tensor:
        if self._quantized is not None:
            logits = self._quantized(hidden).float()
        else:
            weight = _dense_weight(weight_module)
            logits = packed_linear(hidden, weight, self._packed, None).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _dense_weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)  # a dense nn.Linear / nn.Embedding
    return weight
