"""LoRA updates on the shared linear layers, per row of a step.

A linear layer (``TrunkLinear``, ``QuantLinear``) holds, per resident adapter, the low-rank
factors of the checkpoint projections that adapter targets (``LoRAWeights``). The base matmul
runs once for every row of the step; then each adapter active in the step adds
``(x[rows] @ A^T) @ B^T`` (scaling folded into ``B``) to its own rows' output columns only.
Which rows belong to which adapter is the step's ``LoRABatch``, set by the runner through
``forward_context`` (rows without an adapter get nothing added). The runner orders a step's
requests by adapter, so each adapter's rows are one contiguous run: its update reads and
writes slices, with no gather or scatter (measured in docs/performance.md against
``index_select`` / ``index_add_`` per adapter). A step whose runs are all at most
``KERNEL_MAX_RUN_ROWS`` long (decode, prefill, embedding steps) runs every run and block of
the layer as one C++ call (``segmented_update``: ``lora_shrink_expand``,
cenote/kernels/csrc/lora.cpp, sums in fp32); a step with a longer run multiplies per run in
torch. Either way, on a bf16 CPU model a short run multiplies fp32 copies of the factors, a long
one the bf16 ones.

A fused projection (q/k/v, gate/up) is one linear here: an adapter on ``q_proj`` is a block of
the layer's output columns, so its ``B`` spans those columns only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cenote.kernels import ops
from cenote.platforms import runs_cpu_kernels


@dataclass(frozen=True)
class LoRABlock:
    """One adapter's update of one block of output columns of a linear layer."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [end - start, rank], scaling folded in
    start: int  # first output column updated
    end: int  # one past the last
    # fp32 copies of a and b for runs of fewer than SMALL_RUN_ROWS rows (CPU, bf16 models);
    # None: a and b serve every run
    a_small: torch.Tensor | None = None
    b_small: torch.Tensor | None = None


# below this many rows a run's thin matmuls are faster in fp32 than in bf16 on the CPU (the
# crossover measured at 64, docs/performance.md)
SMALL_RUN_ROWS = 48


@dataclass(frozen=True)
class LoRAGroup:
    """A run of consecutive rows of one step that run under one adapter."""

    adapter_id: int  # the adapter's ``lora_int_id``
    start: int  # first row
    end: int | None  # one past the last; None: through the step's last row

    @property
    def rows(self) -> slice:
        return slice(self.start, self.end)


@dataclass(frozen=True)
class LoRABatch:
    """Which adapter each row of a step runs under (rows of no group: the base model only)."""

    groups: tuple[LoRAGroup, ...]


_LORA: ContextVar[LoRABatch | None] = ContextVar("cenote_lora_batch", default=None)


@contextmanager
def lora_context(batch: LoRABatch | None) -> Iterator[None]:
    """Make ``batch`` visible to the linear layers for one forward pass."""
    token = _LORA.set(batch)
    try:
        yield
    finally:
        _LORA.reset(token)


def active_lora_batch() -> LoRABatch | None:
    """The step's adapters, or None when no row of the step has one (or outside a step).
    Fused paths that do not call the linear layers (the C++ decode stack) must add the same
    updates themselves (``LoRASegments``) or step aside when this is not None."""
    return _LORA.get()


class LoRAHost:
    """What a linear layer needs to carry adapters: ``add_lora`` after its base matmul.

    ``lora_blocks`` maps an adapter id to its blocks on this layer; the ``LoRAManager`` writes
    it when an adapter is loaded or evicted."""

    lora_blocks: dict[int, tuple[LoRABlock, ...]]

    def init_lora(self) -> None:
        self.lora_blocks = {}

    def lora_active(self) -> bool:
        """Whether some row of the current step has an adapter that updates this layer."""
        batch = _LORA.get()
        if batch is None or not self.lora_blocks:
            return False
        return any(group.adapter_id in self.lora_blocks for group in batch.groups)

    def add_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base product of ``x [rows, in]``, ``[rows, out]``) plus each active
        adapter's update on its rows, in place: one C++ call for the whole step where it
        measured faster (``segmented_update``), else torch matmuls per run and block."""
        batch = _LORA.get()
        if batch is None or not self.lora_blocks:
            return out
        if segmented_update(x, out, batch, self.lora_blocks):
            return out
        for group in batch.groups:
            blocks = self.lora_blocks.get(group.adapter_id)
            if blocks is None:
                continue
            inputs = x[group.rows]  # [num_rows, in_features]
            small = inputs.shape[0] < SMALL_RUN_ROWS and blocks[0].a_small is not None
            if small:
                inputs = inputs.float()
            for block in blocks:
                a, b = (block.a_small, block.b_small) if small else (block.a, block.b)
                assert a is not None and b is not None  # both copies or neither
                # [num_rows, end - start]
                delta = F.linear(F.linear(inputs, a), b).to(out.dtype)
                out[group.rows, block.start : block.end].add_(delta)
        return out


# the longest run of rows (one adapter's rows in a step) for which one ``lora_shrink_expand``
# call (cenote/kernels/csrc/lora.cpp) beat torch's matmuls per run, per dtype; a step with a
# longer run multiplies in torch (benchmarks/lora.py --only kernel, SmolLM2 and MiniLM shapes,
# docs/performance.md: fp32 1.15-2.2x up to 256 rows a run, 0.8-1.0x past 512 on 576x576 and
# 384x384; bf16, the long runs on vdpbf16ps, 1.05-1.5x at 512 and 1.05-1.1x at 2048 but for
# 576x576)
KERNEL_MAX_RUN_ROWS: dict[torch.dtype, int] = {torch.float32: 256, torch.bfloat16: 2048}


@dataclass
class LoRASegments:
    """``lora_shrink_expand``'s segments, built up one layer at a time: one adapter's run of
    rows times one block of a layer's output columns each."""

    a: list[torch.Tensor]  # [rank, in_features] each
    b: list[torch.Tensor]  # [end - start, rank] each, scaling folded in
    row_starts: list[int]
    row_ends: list[int]
    col_starts: list[int]

    @classmethod
    def empty(cls) -> LoRASegments:
        return cls([], [], [], [], [])

    def add_layer(
        self, batch: LoRABatch, num_rows: int, lora_blocks: dict[int, tuple[LoRABlock, ...]]
    ) -> None:
        """Append a layer's segments for ``batch`` over ``num_rows`` rows. Where a bf16 layer
        keeps fp32 copies of the factors, a run shorter than ``SMALL_RUN_ROWS`` takes them
        (t kept in fp32), a longer one the bf16 factors (vdpbf16ps, measured faster there), as
        the torch path splits them; a run's choice depends on its own length only."""
        for group in batch.groups:
            blocks = lora_blocks.get(group.adapter_id)
            if blocks is None:
                continue
            end = num_rows if group.end is None else group.end
            short = end - group.start < SMALL_RUN_ROWS
            for block in blocks:
                copies = short and block.a_small is not None
                self.a.append(block.a_small if copies and block.a_small is not None else block.a)
                self.b.append(block.b_small if copies and block.b_small is not None else block.b)
                self.row_starts.append(group.start)
                self.row_ends.append(end)
                self.col_starts.append(block.start)


def kernel_takes_runs(batch: LoRABatch, num_rows: int, dtype: torch.dtype) -> bool:
    """Whether ``lora_shrink_expand`` runs the updates of ``batch`` over ``num_rows`` rows of
    ``dtype``: every run at most ``KERNEL_MAX_RUN_ROWS`` long (torch is faster past it)."""
    max_run_rows = KERNEL_MAX_RUN_ROWS.get(dtype)
    if max_run_rows is None:
        return False
    return all(
        (num_rows if group.end is None else group.end) - group.start <= max_run_rows
        for group in batch.groups
    )


def segmented_update(
    x: torch.Tensor,
    out: torch.Tensor,
    batch: LoRABatch,
    lora_blocks: dict[int, tuple[LoRABlock, ...]],
) -> bool:
    """Add every adapter's update of ``batch`` to ``out`` in one kernel call; False (nothing
    done) where the kernel does not apply: no kernel build, not on the CPU, another dtype, a
    strided view, or a run longer than ``KERNEL_MAX_RUN_ROWS`` (``kernel_takes_runs``)."""
    if x.dim() != 2 or out.dtype != x.dtype or not kernel_takes_runs(batch, x.shape[0], x.dtype):
        return False
    if not (x.is_contiguous() and out.is_contiguous()):
        return False
    if not (ops.kernels_built() and runs_cpu_kernels(x, out)):
        return False
    segments = LoRASegments.empty()
    segments.add_layer(batch, x.shape[0], lora_blocks)
    if segments.a:
        ops.lora_shrink_expand(
            out,
            x,
            segments.a,
            segments.b,
            segments.row_starts,
            segments.row_ends,
            segments.col_starts,
            [1.0] * len(segments.a),
        )
    return True
