"""LoRA updates on the shared linear layers, per row of a step.

A linear layer (``TrunkLinear``, ``QuantLinear``) holds, per resident adapter, the low-rank
factors of the checkpoint projections that adapter targets (``LoRAWeights``). The base matmul
runs once for every row of the step; then each adapter active in the step adds
``(x[rows] @ A^T) @ B^T`` (scaling folded into ``B``) to its own rows' output columns only.
Which rows belong to which adapter is the step's ``LoRABatch``, set by the runner through
``forward_context`` (rows without an adapter get nothing added). The runner orders a step's
requests by adapter, so each adapter's rows are one contiguous run: its update reads and
writes slices, with no gather or scatter (measured in docs/performance.md against
``index_select`` / ``index_add_`` per adapter). On a bf16 CPU model a short run (decode rows)
multiplies fp32 copies of the factors, a long one (prefill) the bf16 ones.

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
    Fused paths that do not call the linear layers (a C++ decode stack) must step aside
    when this is not None."""
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
        adapter's update on its rows, in place."""
        batch = _LORA.get()
        if batch is None or not self.lora_blocks:
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
