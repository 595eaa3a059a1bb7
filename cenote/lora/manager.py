"""The adapters resident on one model, and which rows of a step run under each.

``LoRAManager.activate`` reads an adapter folder (``adapter.read_adapter``), checks every
projection against the model (``LoRATarget.linear_slot``: module and output rows, fused q/k/v
and gate/up included) and writes its blocks into those linear layers (``LoRAHost``); a saved
classification head (``modules_to_save``) becomes that adapter's score function
(``heads.py``). At most ``max_loras`` adapters are resident; a new one evicts the least
recently used adapter no request in the engine holds, and is refused when every resident
adapter is held. Up to ``max_cpu_loras`` adapters read from disk are kept in host memory
(least recently used dropped first), so an adapter evicted from the resident set comes back
without reading its folder again (vLLM's ``--max-cpu-loras``). ``prefetch`` reads a folder on
the manager's reader thread, so the engine core parks a request whose adapter is on disk and
keeps stepping the others; ``activate`` then places it from the finished read (between steps,
on the loop thread: no step sees a half-written adapter).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch import nn

from cenote.lora.adapter import LoRAAdapter, read_adapter
from cenote.lora.heads import head_score, head_tensors
from cenote.lora.tasks import is_task_adapter
from cenote.lora_request import LoRARequest
from cenote.models.interfaces import LoRATarget, TaskAdapterModel
from cenote.models.layers.lora import LoRABatch, LoRABlock, LoRAGroup, LoRAHost
from cenote.models.registry import load_model_class
from cenote.pooling.metadata import ScoreFn

if TYPE_CHECKING:
    from cenote.config import ModelConfig


class LoRAManager:
    """Resident adapters by ``lora_int_id``, least recently used first."""

    def __init__(
        self,
        model: object,  # the model: a ``LoRATarget`` takes adapters, others refuse them
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        max_cpu_loras: int | None = None,  # adapters kept in host memory; None: max_loras
    ) -> None:
        self.model = model
        self.device = device
        self.max_loras = max_loras
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self._resident: OrderedDict[int, tuple[LoRARequest, list[LoRAHost]]] = OrderedDict()
        self._heads: dict[int, ScoreFn] = {}  # adapters with their own classification head
        # adapters as read from their folders, least recently used first
        self._host: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()
        self.num_disk_reads = 0  # adapter folders read (the host cache's misses)
        # reads under way or finished on the reader thread, not yet placed by ``activate``
        self._reading: dict[int, tuple[LoRARequest, Future[LoRAAdapter]]] = {}
        self._reader: ThreadPoolExecutor | None = None  # started by the first prefetch

    @property
    def host_cached(self) -> list[LoRARequest]:
        """The adapters kept in host memory, least recently used first."""
        return [request for request, _ in self._host.values()]

    @property
    def resident(self) -> list[LoRARequest]:
        return [request for request, _ in self._resident.values()]

    def activate(self, request: LoRARequest, held: Collection[int] = ()) -> None:
        """Make ``request``'s adapter resident (a no-op when it is); ``held`` are the ids that
        requests in the engine run under (never evicted). ValueError names what is wrong."""
        if is_task_adapter(request.lora_int_id):
            self._check_task_adapter(request)
            return
        entry = self._resident.get(request.lora_int_id)
        if entry is not None:
            if entry[0] != request:
                raise _id_clash(entry[0], request)
            self._resident.move_to_end(request.lora_int_id)
            if request.lora_int_id in self._host:
                self._host.move_to_end(request.lora_int_id)
            return
        if not isinstance(self.model, LoRATarget):
            raise ValueError(f"{type(self.model).__name__} takes no LoRA adapters")
        adapter = self._read(request)
        blocks = self._place(adapter)  # checks everything before anything is written
        heads = head_tensors(self.model, adapter.path, adapter.saved_tensors, self.device)
        if len(self._resident) >= self.max_loras:
            self._evict_one(held, request)
        self._keep_in_host(request, adapter)
        hosts = []
        for host, host_blocks in blocks.items():
            host.lora_blocks[request.lora_int_id] = tuple(host_blocks)
            hosts.append(host)
        if heads:
            self._heads[request.lora_int_id] = head_score(self.model, heads)
        self._resident[request.lora_int_id] = (request, hosts)

    def prefetch(self, request: LoRARequest) -> Future[LoRAAdapter] | None:
        """Start reading ``request``'s folder on the reader thread; None when ``activate``
        would read nothing from disk (resident, in host memory, a task adapter, or refused
        before any read). Concurrent prefetches of one adapter share one read. ValueError when
        another adapter's read under the same ``lora_int_id`` is under way."""
        if is_task_adapter(request.lora_int_id) or not isinstance(self.model, LoRATarget):
            return None
        if request.lora_int_id in self._resident:  # activate names an id clash
            return None
        cached = self._host.get(request.lora_int_id)
        if cached is not None and cached[0] == request:
            return None
        reading = self._reading.get(request.lora_int_id)
        if reading is not None:
            if reading[0] != request:
                raise _id_clash(reading[0], request)
            return reading[1]
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="cenote-lora-read")
        self.num_disk_reads += 1
        future = self._reader.submit(read_adapter, request.lora_path, self.max_lora_rank)
        self._reading[request.lora_int_id] = (request, future)
        return future

    def forget_read(self, lora_int_id: int) -> None:
        """Drop a prefetched read once no parked request waits for it (placed, failed or
        aborted): a later request reads the folder afresh."""
        entry = self._reading.pop(lora_int_id, None)
        if entry is not None:
            entry[1].cancel()  # a read not started yet never starts

    def _check_task_adapter(self, request: LoRARequest) -> None:
        """A checkpoint's own task adapter (``lora/tasks.py``): placed by the model at load,
        always resident; ValueError when this model has no such task."""
        tasks = self.model.task_adapter_ids if isinstance(self.model, TaskAdapterModel) else {}
        if tasks.get(request.lora_name) != request.lora_int_id:
            raise ValueError(
                f"{type(self.model).__name__} has no task adapter {request.lora_name!r} "
                f"(id {request.lora_int_id}); its tasks: {', '.join(tasks) or 'none'}"
            )

    def head_score(self, lora_int_id: int | None) -> ScoreFn | None:
        """The classification head of a resident adapter that saved one (``modules_to_save``);
        None: the model's head serves this request."""
        return None if lora_int_id is None else self._heads.get(lora_int_id)

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter from host memory, else from a finished prefetch (raising its read's
        error), else from its folder."""
        entry = self._host.get(request.lora_int_id)
        if entry is not None and entry[0] == request:
            return entry[1]
        reading = self._reading.get(request.lora_int_id)
        if reading is not None and reading[0] == request and reading[1].done():
            return reading[1].result()
        self.num_disk_reads += 1
        return read_adapter(request.lora_path, self.max_lora_rank)

    def _keep_in_host(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
        """Remember a placed adapter, dropping the least recently used beyond max_cpu_loras."""
        self._host[request.lora_int_id] = (request, adapter)
        self._host.move_to_end(request.lora_int_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def check(self, request: LoRARequest) -> None:
        """Everything ``activate`` checks (the folder, the rank, every projection's shape
        against this model), writing nothing: ValueError names what is wrong. On a model built
        on the meta device (``check_adapter``) it costs reading the adapter file only."""
        if not isinstance(self.model, LoRATarget):
            raise ValueError(f"{type(self.model).__name__} takes no LoRA adapters")
        adapter = read_adapter(request.lora_path, self.max_lora_rank)
        self._place(adapter)
        head_tensors(self.model, adapter.path, adapter.saved_tensors, self.device)

    def deactivate(self, lora_int_id: int) -> bool:
        """Drop a resident adapter; returns whether it was resident."""
        entry = self._resident.pop(lora_int_id, None)
        if entry is None:
            return False
        for host in entry[1]:
            del host.lora_blocks[lora_int_id]
        self._heads.pop(lora_int_id, None)
        return True

    def _evict_one(self, held: Collection[int], incoming: LoRARequest) -> None:
        for lora_int_id in self._resident:  # least recently used first
            if lora_int_id not in held:
                self.deactivate(lora_int_id)
                return
        raise ValueError(
            f"cannot load LoRA adapter {incoming.lora_name!r}: max_loras={self.max_loras} "
            f"adapters are resident and all are in use by running requests; retry later or "
            "raise --max-loras"
        )

    def _place(self, adapter: LoRAAdapter) -> dict[LoRAHost, list[LoRABlock]]:
        """Each projection's blocks on the model's linear layers, shapes checked."""
        model = self.model
        assert isinstance(model, LoRATarget) and isinstance(model, nn.Module)
        blocks: dict[LoRAHost, list[LoRABlock]] = {}
        for name, factors in adapter.factors.items():
            slot = model.linear_slot(name)
            module = None if slot is None else _submodule(model, slot.module)
            if slot is None or not isinstance(module, LoRAHost):
                raise ValueError(
                    f"LoRA adapter {adapter.path} targets {name.removesuffix('.weight')!r}, "
                    f"which is not a linear layer of {type(model).__name__} that adapters "
                    "apply to (supported: the attention and MLP projections of the trunk)"
                )
            in_features = _in_features(module)
            rows = slot.end - slot.start
            if factors.a.shape[1] != in_features or factors.b.shape[0] != rows:
                raise ValueError(
                    f"LoRA adapter {adapter.path} does not fit this base model: "
                    f"{name.removesuffix('.weight')} lora_A is {tuple(factors.a.shape)} and "
                    f"lora_B {tuple(factors.b.shape)}, the base weight is "
                    f"({rows}, {in_features}); is it an adapter for another base model?"
                )
            small = self.device.type == "cpu" and self.dtype != torch.float32
            block = LoRABlock(
                factors.a.to(self.device, self.dtype).contiguous(),
                factors.b.to(self.device, self.dtype).contiguous(),
                slot.start,
                slot.end,
                factors.a.to(self.device).contiguous() if small else None,
                factors.b.to(self.device).contiguous() if small else None,
            )
            blocks.setdefault(module, []).append(block)
        return blocks

    def step_batch(
        self, adapter_ids: Sequence[int | None], row_ends: Sequence[int], num_tokens: Sequence[int]
    ) -> LoRABatch | None:
        """The step's runs of rows per adapter: request ``i`` (adapter ``adapter_ids[i]``,
        None: the base) owns rows ``row_ends[i] - num_tokens[i] ... row_ends[i]``; adjacent
        requests of one adapter make one run (the runner orders requests by adapter). None when
        no row has an adapter, so the base model's fused paths run."""
        if all(adapter_id is None for adapter_id in adapter_ids):
            return None
        if all(adapter_id == adapter_ids[0] for adapter_id in adapter_ids):
            assert adapter_ids[0] is not None
            return LoRABatch((LoRAGroup(adapter_ids[0], 0, None),))
        groups: list[LoRAGroup] = []
        for adapter_id, end, count in zip(adapter_ids, row_ends, num_tokens, strict=True):
            if adapter_id is None:
                continue
            start = end - count
            last = groups[-1] if groups else None
            if last is not None and last.adapter_id == adapter_id and last.end == start:
                groups[-1] = LoRAGroup(adapter_id, last.start, end)
            else:
                groups.append(LoRAGroup(adapter_id, start, end))
        return LoRABatch(tuple(groups))


def shape_checker(model_config: ModelConfig, max_lora_rank: int) -> LoRAManager:
    """A manager over ``model_config``'s layers built on the meta device (shapes, no weights,
    no memory), for the server's front to ``check`` an adapter against the base before any
    engine core sees it (``POST /v1/load_lora_adapter``)."""
    meta = torch.device("meta")
    with meta:
        model = load_model_class(model_config.architecture)(model_config)
    return LoRAManager(model, 1, max_lora_rank, model_config.dtype, meta, max_cpu_loras=0)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _in_features(module: LoRAHost) -> int:
    assert isinstance(module, nn.Module)
    in_features = module.in_features
    assert isinstance(in_features, int)
    return in_features


def _id_clash(holder: LoRARequest, request: LoRARequest) -> ValueError:
    """The error for an adapter asked under an id another adapter already holds."""
    return ValueError(
        f"lora_int_id {request.lora_int_id} is adapter {holder.lora_name!r} "
        f"({holder.lora_path}); {request.lora_name!r} ({request.lora_path}) "
        "needs an id of its own"
    )
