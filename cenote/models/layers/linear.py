"""Linear layers of model trunks, with weights prepacked for oneDNN on CPU.

Measured here (2 cores, AVX512-bf16): a prepacked weight makes a [32, 576] x [576, 3072] bf16
matmul 1.4x faster and fp32 up to 2.5x (the LM head); large batches gain 5-25%. The packed
kernel's rows do not depend on the batch size (a row's result is the same alone or in a batch).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from cenote.kernels import ops
from cenote.models.layers.lora import LoRAHost
from cenote.models.layers.norm import LayerNorm
from cenote.platforms import Platform

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_SIZE_HINT = 32  # oneDNN's blocking hint; measured: results and speed barely depend on it


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """An opaque oneDNN copy of ``weight [out, in]``, or None where prepacking is unavailable."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES:
        return None
    # torch leaves mkldnn.is_available() unannotated (it returns a bool)
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_SIZE_HINT)
    except (RuntimeError, AttributeError) as e:  # a torch build without the op
        logger.info("oneDNN weight prepacking unavailable: %s", e)
        return None


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T + bias`` through the packed weight when there is one."""
    if packed is None or x.dim() != 2 or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class TrunkLinear(LoRAHost, nn.Linear):
    """``nn.Linear`` that runs on a prepacked weight once ``prepack()`` was called (after the
    weights are loaded and cast), or on int8 weights and activations once ``quantize_w8a8()``
    was. The dense ``weight`` stays for state dicts and fallbacks. LoRA adapters of the step
    add their updates after the base matmul (``LoRAHost``); with one active the fused
    epilogues step aside, since the update must land before the GELU or the residual add."""

    _packed: torch.Tensor | None = None
    _int8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # a residual add after this layer runs in the next LayerNorm's kernel, not as the matmul's
    # epilogue (``linear_add_norm``); the platform's choice, set by ``prepack_trunk``
    adds_residual_in_norm: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.init_lora()

    def prepack(self) -> None:
        if self._int8 is None:  # w8a8 layers multiply on their int8 copy
            self._packed = pack_weight(self.weight)

    def quantize_w8a8(self) -> None:
        """Multiply bf16 rows as int8 from now on: the weight per output channel (symmetric),
        each row of ``x`` per call (cenote/kernels/int8_linear.cpp)."""
        packed, scales, col_sums = ops.int8_pack(self.weight.detach())
        self._int8 = (packed, scales, col_sums)
        self._packed = None

    def _int8_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None, gelu: bool
    ) -> torch.Tensor | None:
        """The w8a8 product with its epilogue, or None where it does not apply to ``x``."""
        if self._int8 is None:
            return None
        return ops.int8_linear(x, self._int8, self.bias, residual, gelu)

    @property
    def packed(self) -> torch.Tensor | None:
        """The oneDNN-prepacked weight (after ``prepack``), or None."""
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._int8 is not None and (out := self._int8_linear(x, None, False)) is not None:
            return self.add_lora(x, out)
        return self.add_lora(x, packed_linear(x, self.weight, self._packed, self.bias))

    def forward_gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """``gelu(self(x))``: on a packed weight the GELU (erf or tanh) is the matmul's oneDNN
        epilogue, applied to the fp32 accumulators before the one rounding to the dtype (and
        so is the erf GELU of a w8a8 layer)."""
        if self.lora_active():
            return F.gelu(self(x), approximate=approximate)
        if self._int8 is not None and approximate == "none":
            out = self._int8_linear(x, None, True)
            if out is not None:
                return out
        if self._fusable(x):
            return torch.ops.mkldnn._linear_pointwise(
                x, self._packed, self.bias, "gelu", [], approximate
            )
        return F.gelu(self(x), approximate=approximate)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``: on a packed weight (or a w8a8 layer) the add is the matmul's
        epilogue."""
        if self.lora_active():
            return residual + self(x)
        if self._int8 is not None and (out := self._int8_linear(x, residual, False)) is not None:
            return out
        if self._fusable(x) and residual.dtype == x.dtype and residual.is_contiguous():
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self._packed, self.bias, "add"
            )
        return residual + self(x)

    def _fusable(self, x: torch.Tensor) -> bool:
        return (
            self._packed is not None
            and x.dim() == 2
            and x.dtype == self.weight.dtype
            and x.is_contiguous()
        )


# Hugging Face activation names that are a GELU -> oneDNN's GELU algorithm for them
GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def linear_gelu(layer: nn.Module, x: torch.Tensor, approximate: str) -> torch.Tensor:
    """``gelu(layer(x))``, fused into the matmul where ``layer`` is a packed ``TrunkLinear``."""
    if isinstance(layer, TrunkLinear):
        return layer.forward_gelu(x, approximate)
    return F.gelu(layer(x), approximate=approximate)


def linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + layer(x)``, fused into the matmul where ``layer`` is a packed
    ``TrunkLinear``."""
    if isinstance(layer, TrunkLinear):
        return layer.forward_add(x, residual)
    return residual + layer(x)


def linear_add_norm(
    layer: nn.Module, x: torch.Tensor, residual: torch.Tensor, norm: LayerNorm
) -> torch.Tensor:
    """``norm(residual + layer(x))``, written over the sum (a temporary of the caller)."""
    if (
        isinstance(layer, TrunkLinear)
        and layer._int8 is None  # w8a8's own epilogue adds in fp32
        and x.dim() == 2
        and x.dtype == layer.weight.dtype
        and x.is_contiguous()  # packed or not: the choice is the norm's, not the matmul's
        and layer.adds_residual_in_norm
        and norm.runs_in_place(residual)
    ):
        return norm.add_normalize_(layer(x), residual)
    return norm.normalize_(linear_add(layer, x, residual))


def quantize_trunk_w8a8(model: nn.Module) -> int:
    """Every ``TrunkLinear`` of ``model`` multiplies as w8a8 from now on; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, TrunkLinear):
            module.quantize_w8a8()
            count += 1
    return count


def prepack_trunk(model: nn.Module, platform: Platform) -> int:
    """Prepack every ``TrunkLinear`` of ``model`` and give it ``platform``'s place for the
    residual add before a LayerNorm: the norm's kernel where the platform has
    ``residual_add_in_norm`` (AVX512-BF16 without AMX: docs/performance.md), else the matmul's
    epilogue. Returns how many were packed."""
    in_norm = platform.supports("residual_add_in_norm")
    count = 0
    for module in model.modules():
        if isinstance(module, TrunkLinear):
            module.adds_residual_in_norm = in_norm
            module.prepack()
            count += module._packed is not None
    return count


def linear_fp32(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(x)`` computed in fp32 whatever the layer's dtype: classification heads run in
    fp32 (their logits are compared at 1e-5)."""
    bias = None if linear.bias is None else linear.bias.float()
    return F.linear(x.float(), linear.weight.float(), bias)
