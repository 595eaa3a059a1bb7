"""A decode step's layer loop as one C++ call (cenote/kernels/csrc/decode_stack.cpp): the runner's
execution strategy for pre-norm decoders on the CPU, bit-identical to the model's own layer loop.

A model offers its layers through ``FusedDecodeModel`` (models/interfaces.py): it describes them
(``DecodeStackSpec``: projections, norms, attention sizes, scales, windows) and takes the step
this module builds (``use_fused_decode``). Its ``forward`` calls the step first; the step returns
None where it does not apply (a step with prompt rows, more rows than a projection's fused kernel
takes, a LoRA run longer than the LoRA kernel takes), and the model's loop runs.

A step with LoRA rows hands the stack each projection's segments (one adapter's run of rows
times one block of columns), built here from the step's ``LoRABatch`` and the projections'
``lora_blocks`` by the code the linear layers use (``LoRASegments``): the same factors (per
run, the fp32 copies or the bf16 factors of a bf16 layer), the same kernel, so the stack stays
bit-identical to the loop. Where a run is past ``KERNEL_MAX_RUN_ROWS`` the loop multiplies in
torch, so the stack steps aside rather than differ.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cenote.forward_context import get_attention_metadata
from cenote.kernels import DecodeStack, ops
from cenote.models.interfaces import DecodeStackSpec, FusedDecodeModel
from cenote.models.layers.attention_plan import paged_plan
from cenote.models.layers.linear import TrunkLinear
from cenote.models.layers.lora import (
    LoRABatch,
    LoRAHost,
    LoRASegments,
    active_lora_batch,
    kernel_takes_runs,
)
from cenote.models.layers.quant import QuantLinear
from cenote.platforms import Platform

logger = logging.getLogger(__name__)

_StackLinear = tuple[
    torch.Tensor | None,  # q
    torch.Tensor | None,  # scale
    torch.Tensor | None,  # mn
    int,  # bits
    int,  # group
    int,  # fused_max_rows
    int,  # dot_max_rows
    torch.Tensor | None,  # packed
    torch.dtype,  # dense_dtype
    torch.Tensor | None,  # bias
]


def use_decode_stack(model: object, platform: Platform) -> bool:
    """Give ``model`` a ``DecodeStackStep`` where it offers its layers and the stack takes them
    (a platform with cenote's CPU kernels, every projection quantized or prepacked, the kernels
    built); returns whether it did."""
    if not platform.supports("cpu_kernels") or not isinstance(model, FusedDecodeModel):
        return False
    spec = model.decode_stack_spec()
    step = None if spec is None else DecodeStackStep.build(spec)
    if step is None:
        return False
    model.use_fused_decode(step)
    return True


class DecodeStackStep:
    """``step(x, cos, sin) -> hidden | None``: ``x [rows, hidden]`` the embeddings of a step whose
    rows each decode one token; returns the final norm's output, or None where the stack does
    not apply to this step."""

    def __init__(
        self,
        stack: DecodeStack,
        spec: DecodeStackSpec,
        max_rows: float,
        projections: list[LoRAHost],
    ) -> None:
        self.stack = stack
        self.spec = spec
        self.max_rows = max_rows  # the fewest rows a projection multiplies in the stack
        self.projections = projections  # in the stack's order: qkv, o, gate_up, down per layer

    @classmethod
    def build(cls, spec: DecodeStackSpec) -> DecodeStackStep | None:
        """The stack of ``spec``'s layers, or None where a projection does not fit it (dense
        and not prepacked, split into parts) or the kernels did not build."""
        linears = [_stack_linear(module) for layer in spec.layers for module in layer.projections]
        if not linears or any(linear is None for linear in linears):
            return None
        stack = ops.decode_stack(spec.num_heads, spec.num_kv_heads, spec.head_dim)
        if stack is None:
            return None
        for i, layer in enumerate(spec.layers):
            for linear in linears[4 * i : 4 * i + 4]:  # qkv, o, gate_up, down
                assert linear is not None
                stack.add_linear(*linear[0])
            post, following = layer.post_attention_norm, layer.next_norm
            stack.add_layer(
                post.weight,
                post.eps,
                following.weight,
                following.eps,
                layer.scale,
                layer.cache_index,
            )
        max_rows = min(linear[1] for linear in linears if linear is not None)
        projections: list[LoRAHost] = []
        for layer in spec.layers:
            for module in layer.projections:
                assert isinstance(module, LoRAHost)  # QuantLinear / TrunkLinear: _stack_linear
                projections.append(module)
        return cls(stack, spec, max_rows, projections)

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        if x.device.type != "cpu":
            return None  # the stack reads the weights through host pointers
        if x.shape[0] > self.max_rows or x.dtype not in (torch.float32, torch.bfloat16):
            return None
        batch = active_lora_batch()
        if batch is not None and not kernel_takes_runs(batch, x.shape[0], x.dtype):
            return None  # the layers multiply this step's long runs in torch
        metadata = get_attention_metadata()
        if metadata.kv_caches is None or metadata.slot_mapping is None:
            return None
        plans = [paged_plan(metadata, window) for window in self.spec.windows]
        if not plans[0].all_decode or x.dtype != metadata.kv_caches[0].dtype:
            return None
        tables, starts, ends = [], [], []
        for plan in plans:
            assert plan.decode_tables is not None and plan.decode_starts is not None
            assert plan.decode_ends is not None  # all-decode plans have all three
            tables.append(plan.decode_tables)
            starts.append(plan.decode_starts)
            ends.append(plan.decode_ends)
        segments, offsets = self._lora_segments(batch, x.shape[0])
        residual = x.contiguous()  # the stack adds each layer's outputs into it, in place
        return self.stack.run(
            residual,
            self.spec.first_norm(residual),
            cos,
            sin,
            metadata.kv_caches,
            metadata.slot_mapping,
            tables,
            starts,
            ends,
            segments.a,
            segments.b,
            segments.row_starts,
            segments.row_ends,
            segments.col_starts,
            offsets,
        )

    def _lora_segments(
        self, batch: LoRABatch | None, num_rows: int
    ) -> tuple[LoRASegments, list[int]]:
        """Every projection's segments of the step, flat, and where each projection's segments
        lie in them (``offsets[p]:offsets[p + 1]``); no offsets for a step without adapters."""
        segments = LoRASegments.empty()
        if batch is None:
            return segments, []
        offsets = [0]
        for module in self.projections:
            if module.lora_blocks:
                segments.add_layer(batch, num_rows, module.lora_blocks)
            offsets.append(len(segments.a))
        return segments, offsets


def _stack_linear(module: nn.Module) -> tuple[_StackLinear, float] | None:
    """``DecodeStack.add_linear``'s arguments for a projection and the most rows the stack can
    multiply it at, as its module would (QuantLinear: the fused kernel, then its dense copy;
    TrunkLinear: its prepacked weight), or None where the stack cannot."""
    if isinstance(module, QuantLinear) and len(module.parts) == 1:
        part, packed = module.parts[0], module.dense_packed
        dense_dtype = module.dense_dtype or torch.float32
        rows = float("inf") if packed is not None else module.fused_max_rows
        args = (part.qdata, part.scales, part.mins, part.bits, part.group, module.fused_max_rows)
        rows = max(rows, module.dot_max_rows)
        return (*args, module.dot_max_rows, packed, dense_dtype, module.bias), rows
    if isinstance(module, TrunkLinear) and module.packed is not None:
        spec = (None, None, None, 0, 0, 0, 0, module.packed, module.weight.dtype, module.bias)
        return spec, float("inf")
    return None
