"""How the engine cores of several models share this machine's CPUs (``cenote serve --model
A=... --model B=...``), so that their torch threads never outnumber the cores.

The policy, for K engine cores (a model's data-parallel replicas count one each) on the C CPUs
this process may run on:

- C >= 2K: disjoint CPU sets. Each core gets a contiguous run of C // K CPUs (the first C % K
  cores one more), is pinned to it (``os.sched_setaffinity`` in the core process) and runs as
  many threads as it has CPUs: one model's burst never slows another's step.
- C < 2K: one shared set, no pinning; thread counts that sum to C (C // K each, the first C % K
  one more), at least one each (so K > C gives one thread each, K in all). Below two CPUs a
  core, pinning would keep a core on its one CPU while the others sit idle; unpinned, the OS
  moves the busy core's threads onto idle CPUs.

A model whose options set ``num_threads`` keeps it (unpinned: the user has chosen), and a model
on a GPU is left alone; the others split the CPUs as above. A data-parallel model's share is
split between its replicas by ``dp_client.split_cores`` (disjoint runs inside the model's set).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from cenote.config import EngineConfig


@dataclass(frozen=True)
class CoreShare:
    """What one model's engine cores get: threads in all, and the CPUs (None: not pinned)."""

    num_threads: int
    cpu_ids: tuple[int, ...] | None


def plan_cpu_shares(
    num_cores: Sequence[int | None], available: Sequence[int]
) -> list[CoreShare | None]:
    """The share of each model (``num_cores[i]``: its engine cores, None: left alone) on the
    CPUs ``available``; None for a model left alone."""
    cpus = sorted(available)
    total_cores = sum(n for n in num_cores if n is not None)
    if total_cores == 0:
        return [None] * len(num_cores)
    base, extra = divmod(len(cpus), total_cores)
    # the k-th engine core overall gets base CPUs or threads, the first `extra` one more
    sizes = [max(base + (k < extra), 1) for k in range(total_cores)]
    pinned = len(cpus) >= 2 * total_cores
    shares: list[CoreShare | None] = []
    first_core, first_cpu = 0, 0
    for count in num_cores:
        if count is None:
            shares.append(None)
            continue
        width = sum(sizes[first_core : first_core + count])
        cpu_ids = tuple(cpus[first_cpu : first_cpu + width]) if pinned else None
        shares.append(CoreShare(num_threads=width, cpu_ids=cpu_ids))
        first_core, first_cpu = first_core + count, first_cpu + width
    return shares


def share_cpus(
    configs: Sequence[EngineConfig], data_parallel_sizes: Sequence[int], available: Sequence[int]
) -> list[EngineConfig]:
    """Each model's config with its share applied (``plan_cpu_shares``): ``num_threads`` (all
    its replicas together) and ``cpu_ids``."""
    return share_cpus_and_slots(configs, data_parallel_sizes, available)[0]


def share_cpus_and_slots(
    configs: Sequence[EngineConfig],
    data_parallel_sizes: Sequence[int],
    available: Sequence[int],
    num_slots: int = 0,
    slot_size: int = 1,
) -> tuple[list[EngineConfig], list[CoreShare | None]]:
    """``share_cpus``, with ``num_slots`` more models of ``slot_size`` engine cores each counted
    in the plan: the ``--max-loaded-models`` models of ``--models-dir`` that may be loaded at
    once, whose shares (returned) go to the models loaded into them (``apply_share``)."""
    num_cores = [
        size if config.model.device == "cpu" and config.num_threads is None else None
        for config, size in zip(configs, data_parallel_sizes, strict=True)
    ]
    shares = plan_cpu_shares([*num_cores, *[slot_size] * num_slots], available)
    shared = [
        apply_share(config, share)
        for config, share in zip(configs, shares[: len(configs)], strict=True)
    ]
    return shared, shares[len(configs) :]


def apply_share(config: EngineConfig, share: CoreShare | None) -> EngineConfig:
    """``config`` on its share; unchanged without one, on a GPU or with its own thread count."""
    if share is None or config.model.device != "cpu" or config.num_threads is not None:
        return config
    return dataclasses.replace(config, num_threads=share.num_threads, cpu_ids=share.cpu_ids)
