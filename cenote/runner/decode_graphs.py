"""CUDA graphs for all-decode steps: the trunk of a step whose rows are each one new token of a
generation request, replayed from a graph captured per padded batch size (vLLM's design).

A decode step of a small model is bounded by launches, not math: hundreds of kernels a step,
each a few microseconds of Python and dispatch. A graph replays them in one call. Graphs need
fixed shapes and fixed addresses, so:

- sizes: 1, 2, 4, ... up to ``max_num_seqs`` (and it); a step of ``n`` rows runs the smallest
  size >= ``n``, its padding rows after the real ones.
- inputs: one static buffer on the device, a row per batch row (token id, position, KV slot,
  and for each sliding window of the model the row's key range and block table, the table at
  its full width ``ceil(max_model_len / block_size)``). The host writes a step's rows into a
  pinned staging copy and sends them in one non-blocking copy; everything the layers read
  (``slot_mapping``, the decode plans of ``attention_plan``) are views of that buffer, set in
  the step's ``AttentionMetadata`` before the trunk runs, so no layer builds an index tensor
  inside the graph.
- padding rows write their key and value to a scratch KV block that no request owns (the
  engine allocates one block more than the cache manager hands out) and attend to it alone.

Graphs are captured at start-up (``capture``, largest size first so the smaller ones reuse its
memory pool), as vLLM does: a request's first step never pays a capture, and the memory the
graphs hold is taken before the first request. Only steps without pooling rows or LoRA
adapters are eligible (``takes``); every other step runs eagerly. On the host (tests) the
same code runs with ``EagerGraph``, which calls the trunk again on every replay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from cenote.forward_context import AttentionMetadata, forward_context
from cenote.models.interfaces import DecoderModel
from cenote.models.layers.attention_plan import first_visible_block, preset_decode_plan
from cenote.models.layers.lora import lora_context
from cenote.scheduler.output import ScheduledRequest

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

Forward = Callable[[], torch.Tensor]  # the trunk over the static inputs -> [size, hidden]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself (ascending)."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*sizes, max_num_seqs]


def graph_size(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``num_rows`` rows, or None."""
    return next((size for size in sizes if size >= num_rows), None)


def is_decode_step(scheduled: Sequence[ScheduledRequest]) -> bool:
    """Every row is one new token of a generation request on the base model."""
    return bool(scheduled) and all(
        s.num_tokens == 1
        and s.pooling_params is None
        and s.lora_int_id is None
        and s.token_type_ids is None
        for s in scheduled
    )


class StepGraph(Protocol):
    """A captured trunk: ``capture`` once, then ``replay`` per step (same output tensor)."""

    def capture(self, forward: Forward) -> None: ...

    def replay(self) -> torch.Tensor: ...


class CudaGraph:
    """``torch.cuda.CUDAGraph`` around the trunk, in a memory pool shared by all sizes."""

    def __init__(self, pool: _POOL_HANDLE) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.output: torch.Tensor | None = None

    def capture(self, forward: Forward) -> None:
        forward()  # warm-up outside the graph: Triton compiles, cuBLAS picks its kernels
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.output = forward()

    def replay(self) -> torch.Tensor:
        assert self.output is not None  # captured
        self.graph.replay()
        return self.output


class EagerGraph:
    """The host's stand-in: ``replay`` runs the trunk again over the same static inputs."""

    def __init__(self) -> None:
        self.forward: Forward | None = None

    def capture(self, forward: Forward) -> None:
        self.forward = forward
        forward()

    def replay(self) -> torch.Tensor:
        assert self.forward is not None  # captured
        return self.forward()


class DecodeGraphs:
    """The graphs of one model runner and their static inputs.

    Row layout of the input buffer (int64): token id, position, KV slot, then per window
    ``(first key, end key)`` in table positions, then per window the block table."""

    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.windows = model.attention_windows  # one decode plan each
        self.table_width = -(-max_model_len // block_size)
        self._tables_at = 3 + 2 * len(self.windows)  # first column of the first window's table
        columns = self._tables_at + len(self.windows) * self.table_width
        pinned = device.type == "cuda"
        self.staging = torch.zeros(self.sizes[-1], columns, dtype=torch.long, pin_memory=pinned)
        self.inputs = torch.zeros(self.sizes[-1], columns, dtype=torch.long, device=device)
        self._staged: torch.cuda.Event | None = None  # the last copy out of ``staging``
        self.graphs: dict[int, StepGraph] = {}

    def _new_graph(self) -> Callable[[], StepGraph]:
        if self.device.type != "cuda":
            return EagerGraph
        pool = torch.cuda.graph_pool_handle()
        return lambda: CudaGraph(pool)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, over padding rows only."""
        new_graph = self._new_graph()
        for size in reversed(self.sizes):
            self._stage([], size)
            graph = new_graph()
            graph.capture(functools.partial(self.forward, size))
            self.graphs[size] = graph

    def takes(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """Whether this step replays a graph: all decode rows, no more than the largest size."""
        return len(scheduled) <= self.sizes[-1] and is_decode_step(scheduled)

    def run(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """The trunk's hidden states of a step that ``takes``: [len(scheduled), hidden]. The
        result lives in the graph's memory: read it before the next step."""
        size = graph_size(len(scheduled), self.sizes)
        assert size is not None  # takes(scheduled)
        self._stage(scheduled, size)
        return self.graphs[size].replay()[: len(scheduled)]

    def forward(self, size: int) -> torch.Tensor:
        """The trunk over the first ``size`` rows of the static inputs (what a graph captures).
        The metadata's host lists describe no real step: the preset plans carry the key ranges
        and nothing in an all-decode pass reads the lists."""
        rows = self.inputs[:size]
        metadata = AttentionMetadata(
            query_start_loc=list(range(size + 1)),
            seq_lens=[1] * size,
            causal=True,
            slot_mapping=rows[:, 2].contiguous(),
            block_size=self.block_size,
            kv_caches=self.kv_caches,
            device=self.device,
        )
        for i, window in enumerate(self.windows):
            first = self._tables_at + i * self.table_width
            tables = rows[:, first : first + self.table_width]  # strided rows: the kernels take it
            starts, ends = rows[:, 3 + 2 * i].contiguous(), rows[:, 4 + 2 * i].contiguous()
            preset_decode_plan(metadata, window, tables=tables, starts=starts, ends=ends)
        with forward_context(metadata), lora_context(None):
            hidden: torch.Tensor = self.model(
                rows[:, 0].contiguous(), rows[:, 1].contiguous(), None
            )
        return hidden  # [size, hidden]

    def _stage(self, scheduled: Sequence[ScheduledRequest], size: int) -> None:
        """Write the rows of ``scheduled`` and ``size - len(scheduled)`` padding rows into the
        input buffer: on the host into ``staging``, then one copy to the device."""
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copy has left the staging rows
        size_of_block = self.block_size
        scalars: list[list[int]] = []  # [size, 3 + 2 * windows]
        tables: list[list[list[int]]] = [[] for _ in self.windows]  # per window [size, blocks]
        for s in scheduled:
            position, block_ids = s.start_position, s.block_ids
            slot = block_ids[position // size_of_block] * size_of_block + position % size_of_block
            row = [s.token_ids[0], position, slot]
            for i, window in enumerate(self.windows):
                first = first_visible_block(position, window, size_of_block)
                end = position + 1 - first * size_of_block  # one past the new key
                row += (0 if window is None else max(end - window, 0), end)
                tables[i].append(block_ids[first : first + -(-end // size_of_block)])
            scalars.append(row)
        padding = size - len(scheduled)  # key and value to the scratch block's first slot
        scratch = self.scratch_block
        scalars += [[0, 0, scratch * size_of_block] + [0, 1] * len(self.windows)] * padding
        self.staging[:size, : self._tables_at] = torch.tensor(scalars, dtype=torch.long)
        for i, window_tables in enumerate(tables):
            window_tables += [[scratch]] * padding
            width = max(len(t) for t in window_tables)
            padded = [t + [scratch] * (width - len(t)) for t in window_tables]
            start = self._tables_at + i * self.table_width
            self.staging[:size, start : start + width] = torch.tensor(padded, dtype=torch.long)
        self.inputs[:size].copy_(self.staging[:size], non_blocking=True)
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._staged.record()
