"""The engine core: scheduler + model runner. ``step()`` = schedule -> execute -> update."""

from __future__ import annotations

import logging
import os

import torch

from cenote.config import EngineConfig
from cenote.engine.input_processor import ModelCapabilities
from cenote.engine.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from cenote.kv_cache.manager import KVCacheManager, num_blocks_for_memory
from cenote.models.loader import load_model
from cenote.models.registry import get_entry
from cenote.pooling.builder import build_embedding_pooler
from cenote.runner.model_runner import ModelRunner
from cenote.scheduler.request import Request, RequestStatus
from cenote.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

_DEFAULT_KV_BYTES = 1 << 30  # upper bound of the KV cache when no budget is given (~46k tokens of SmolLM2 in bf16)


class EngineCore:
    """Owns the model, the KV cache and the scheduler. Runs in-process (offline) or in its own
    process (server); it never tokenizes or detokenizes."""

    def __init__(self, config: EngineConfig) -> None:
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        self.config = config
        model_config = config.model
        entry = get_entry(model_config.architecture)
        self.model = load_model(model_config)
        pooler = None
        if "embed" in entry.tasks:
            pooler = build_embedding_pooler(model_config, self.model.hidden_size, entry.is_causal)
        self.pooler = pooler
        kv_manager, kv_caches = None, None
        if entry.is_causal:
            kv_manager, kv_caches = self._make_kv_cache()
        self.kv_cache_manager = kv_manager
        self.runner = ModelRunner(config, self.model, pooler, kv_caches)
        cacheable = frozenset({"embed"} if pooler is not None and pooler.method == "last" else ())
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            kv_manager,
            prefix_cacheable_tasks=cacheable,
            max_model_len=model_config.max_model_len,
        )
        self.capabilities = ModelCapabilities(
            supported_tasks=entry.tasks,
            embedding_size=pooler.output_size if pooler is not None else None,
            is_matryoshka=model_config.is_matryoshka,
            eos_token_id=model_config.hf_config.get("eos_token_id"),
        )

    def _make_kv_cache(self) -> tuple[KVCacheManager, list[torch.Tensor]]:
        cache = self.config.cache
        model = self.model
        num_blocks = cache.num_gpu_blocks_override
        if num_blocks is None:
            budget = cache.kv_cache_memory_bytes or _default_kv_budget()
            num_blocks = num_blocks_for_memory(
                budget,
                model.num_layers,
                model.num_kv_heads,
                model.head_dim,
                cache.block_size,
                self.config.model.dtype,
            )
        shape = (2, num_blocks, cache.block_size, model.num_kv_heads, model.head_dim)
        kv_caches = [
            torch.zeros(shape, dtype=self.config.model.dtype) for _ in range(model.num_layers)
        ]
        manager = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, cache.block_size)
        return manager, kv_caches

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                pooling_params=request.pooling_params,
                token_type_ids=request.token_type_ids,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time,
                priority=request.priority,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        # 1) schedule
        scheduler_output = self.scheduler.schedule()
        # 2) execute
        runner_output = self.runner.execute(scheduler_output)
        # 3) update
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(
            outputs=outputs, stats=self._stats(scheduler_output.total_num_scheduled_tokens)
        )

    def _stats(self, num_scheduled_tokens: int) -> SchedulerStats:
        manager = self.kv_cache_manager
        return SchedulerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_scheduled_tokens=num_scheduled_tokens,
            kv_cache_usage=manager.usage if manager is not None else 0.0,
            prefix_cache_queries=manager.queries if manager is not None else 0,
            prefix_cache_hits=manager.hits if manager is not None else 0,
        )


def _default_kv_budget() -> int:
    """A quarter of the available memory, at most 1 GiB."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = _DEFAULT_KV_BYTES
    return min(_DEFAULT_KV_BYTES, available // 4)
