"""The engine core: scheduler + model runner. ``step()`` = schedule -> execute -> update."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from cenote.config import EngineConfig
from cenote.engine.capabilities import ModelCapabilities, ScoreType
from cenote.engine.heap import release_freed_memory
from cenote.engine.pooler_builder import build_pooler
from cenote.kv_cache.manager import (
    KVCacheManager,
    kv_cache_bytes_per_block,
    num_blocks_for_memory,
    num_blocks_per_request,
)
from cenote.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestError,
    SchedulerStats,
)
from cenote.models.interfaces import DecoderModel, ImageTextModel, Model
from cenote.models.layers.attention import kv_cache_shape
from cenote.models.loader import load_model
from cenote.models.registry import get_entry
from cenote.platforms import num_gpu_kv_blocks
from cenote.pooling.pooler import DispatchPooler
from cenote.request import Request, RequestStatus
from cenote.runner.draft_model import DraftModelProposer
from cenote.runner.memory_profile import graph_reserve_bytes, profile_step_peak
from cenote.runner.model_runner import ModelRunner
from cenote.scheduler.output import SchedulerOutput
from cenote.scheduler.scheduler import Scheduler
from cenote.structured.grammar import GrammarCompiler
from cenote.tasks import PoolingTask, SupportedTask

logger = logging.getLogger(__name__)

# this many failed steps in a row: the core itself is broken, not one request
_MAX_CONSECUTIVE_STEP_FAILURES = 3
# with nothing to run but requests whose grammars compile: how long a step waits for one
_GRAMMAR_WAIT_SECONDS = 0.05


class EngineCore:
    """Owns the model, the KV cache and the scheduler. Runs in-process (offline) or in its own
    process (server); it never tokenizes or detokenizes."""

    def __init__(self, config: EngineConfig) -> None:
        # the core process pinned itself to config.cpu_ids (core_proc); None: the process's
        config.platform.pin_threads(config.num_threads, None)
        self.config = config
        model_config = config.model
        entry = get_entry(model_config.architecture)
        # CUDA: what the process held before this engine (other engines), not counted as its own
        self._baseline_bytes = torch.cuda.memory_allocated() if on_cuda(config) else 0
        model = load_model(model_config, config.platform)
        if not isinstance(model, Model):
            raise TypeError(
                f"{type(model).__name__} does not declare the Model contract "
                "(cenote/models/interfaces.py)"
            )
        self.model = model
        pooler = build_pooler(model_config, model, entry)
        if pooler is not None:
            pooler = pooler.to(model_config.device)  # heads (e.g. Dense) load on the host
        self.pooler = pooler
        kv_manager, kv_caches = None, None
        release_freed_memory()  # the loader's temporaries, before the KV cache sets the peak
        if entry.is_causal:
            kv_manager, kv_caches = self._make_kv_cache()
        keep_step_memory()  # from here on: steps, whose activations the next step reuses
        self.kv_cache_manager = kv_manager
        self.runner = ModelRunner(config, self.model, pooler, kv_caches)
        for adapter in config.lora.modules:  # served by name: checked and resident from the start
            self.runner.lora.activate(adapter)
        self.runner.capture_decode_graphs()  # CUDA: after the weights and cache are final
        cacheable: frozenset[PoolingTask] = frozenset()  # tasks that may reuse the prefix cache
        if pooler is not None:
            tasks = pooler.get_supported_tasks()
            cacheable = frozenset(t for t in tasks if pooler.requirements(t).prefix_cache_safe)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            kv_manager,
            prefix_cacheable_tasks=cacheable,
            max_model_len=model_config.max_model_len,
            speculative=config.speculative,
            proposer=self._draft_proposer(kv_manager),
        )
        self.capabilities = self._capabilities(entry.tasks, pooler)
        self._consecutive_failures = 0
        self._grammars: GrammarCompiler | None = None  # built by the first structured request
        self._compiling: dict[str, Request] = {}  # requests waiting for their grammar, in order
        # requests waiting for their LoRA adapter's folder to be read, in order
        self._loading: dict[str, tuple[Request, Future[Any]]] = {}

    def _draft_proposer(self, kv_manager: KVCacheManager | None) -> DraftModelProposer | None:
        """``method: draft_model``: the draft model, loaded beside the target; None otherwise
        (n-gram drafts need no model)."""
        speculative = self.config.speculative
        if speculative is None or speculative.method != "draft_model":
            return None
        assert kv_manager is not None  # create_engine_config: speculation needs a decoder
        return DraftModelProposer(self.config, kv_manager.num_blocks)

    def _capabilities(
        self, tasks: tuple[SupportedTask, ...], pooler: DispatchPooler | None
    ) -> ModelCapabilities:
        model_config, model = self.config.model, self.model
        num_labels = pooler.num_labels if pooler is not None else None
        embedder = pooler.embedding_pooler if pooler is not None else None
        return ModelCapabilities(
            supported_tasks=tasks,
            embedding_size=pooler.embedding_size if pooler is not None else None,
            is_matryoshka=model_config.is_matryoshka,
            eos_token_id=model_config.hf_config.get("eos_token_id"),
            num_labels=num_labels,
            label_names=_label_names(model_config.hf_config, num_labels),
            score_type=_score_type(model_config.hf_config, tasks),
            uses_token_type_ids=int(model_config.hf_config.get("type_vocab_size", 0)) > 1,
            chunkable_pooling=embedder.chunkable_method if embedder is not None else None,
            normalizes_embeddings=embedder.head.default_normalize if embedder else True,
            num_image_tokens=model.num_image_tokens if isinstance(model, ImageTextModel) else None,
            image_size=model.image_size if isinstance(model, ImageTextModel) else None,
            embeds_text=model.embeds_text if isinstance(model, ImageTextModel) else True,
        )

    def _make_kv_cache(self) -> tuple[KVCacheManager, list[torch.Tensor]]:
        cache = self.config.cache
        model = self.model
        if not isinstance(model, DecoderModel):
            raise TypeError(f"{type(model).__name__} is causal but declares no KV cache layout")
        bytes_per_block = kv_cache_bytes_per_block(
            model.num_layers, model.num_kv_heads, model.head_dim, cache.block_size,
            self.config.model.dtype,
        )  # fmt: skip
        num_blocks = cache.num_gpu_blocks_override
        if num_blocks is None and cache.kv_cache_memory_bytes is None and on_cuda(self.config):
            num_blocks = self._profile_kv_blocks(bytes_per_block)
        if num_blocks is None:
            budget = cache.kv_cache_memory_bytes or self.config.platform.kv_cache_budget_bytes()
            num_blocks = num_blocks_for_memory(
                budget,
                model.num_layers,
                model.num_kv_heads,
                model.head_dim,
                cache.block_size,
                self.config.model.dtype,
            )
        _check_kv_cache_fits(self.config, num_blocks, bytes_per_block, model.kv_sliding_window)
        # with CUDA graphs one block more, never handed out: the padding rows' scratch block
        allocated = num_blocks + 1 if self.config.cuda_graphs else num_blocks
        shape = kv_cache_shape(allocated, cache.block_size, model.num_kv_heads, model.head_dim)
        dtype, device = self.config.model.dtype, self.config.model.device
        kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)
        ]
        # every layer slides: blocks behind the window are freed as requests advance
        manager = KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, model.kv_sliding_window
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%s)",
            num_blocks,
            cache.block_size,
            _size(num_blocks * bytes_per_block),
        )
        return manager, kv_caches

    def _profile_kv_blocks(self, bytes_per_block: int) -> int | None:
        """CUDA: the blocks that fit in ``gpu_memory_utilization`` of the GPU once this
        engine's weights, one largest step and the decode graphs have their memory, and in
        what the GPU has free. None when the profiling step itself fails (other than out of
        memory): the cache is then sized from ``kv_cache_memory_bytes``' default, with a
        warning naming the cause, rather than the engine refusing to start."""
        try:
            peak, activations = profile_step_peak(
                self.config, self.model, self.pooler, self._baseline_bytes
            )
        except torch.cuda.OutOfMemoryError as e:
            raise ValueError(
                f"the profiling step of max_num_batched_tokens "
                f"({self.config.scheduler.max_num_batched_tokens}) tokens ran out of GPU memory "
                f"({e}); lower --max-num-batched-tokens or --max-num-seqs"
            ) from e
        except Exception as e:
            logger.warning(
                "the KV cache's profiling step failed (%s: %s): the cache is sized from "
                "kv_cache_memory_bytes' default instead of --gpu-memory-utilization",
                type(e).__name__,
                e,
            )
            return None
        reserve = graph_reserve_bytes(self.config, activations)
        free, total = torch.cuda.mem_get_info()
        utilization = self.config.cache.gpu_memory_utilization
        num_blocks = num_gpu_kv_blocks(
            total_bytes=total,
            utilization=utilization,
            peak_bytes=peak,
            activation_bytes=activations,
            free_bytes=free,
            graph_reserve_bytes=reserve,
            bytes_per_block=bytes_per_block,
        )
        logger.info(
            "KV cache sized from gpu_memory_utilization=%s of %s: weights + one step peak at "
            "%s (activations %s), CUDA graphs %s, %s free: %d blocks (%s)",
            utilization,
            _size(total),
            _size(peak),
            _size(activations),
            _size(reserve),
            _size(free),
            num_blocks,
            _size(num_blocks * bytes_per_block),
        )
        return num_blocks

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; outside the scheduler, one whose LoRA adapter is on disk waits for
        its folder to be read (on the adapter manager's reader thread) and one with structured
        outputs for its grammar (compiled on the compiler's thread)."""
        core_request = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            pooling_params=request.pooling_params,
            token_type_ids=request.token_type_ids,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            group_id=request.group_id,
            lora_request=request.lora_request,
            pixel_values=request.pixel_values,
        )
        request_id = request.request_id
        if request_id in self._compiling or request_id in self._loading:  # not the scheduler's
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if request.lora_request is not None:
            read = self.runner.lora.prefetch(request.lora_request)
            if read is not None and not read.done():  # its folder is read off the loop thread
                if request_id in self.scheduler.requests:
                    raise ValueError(f"request id {request_id!r} is already in the engine")
                self._loading[request_id] = (core_request, read)
                return
            try:
                self.runner.lora.activate(request.lora_request, self._held_adapters())
            finally:  # a finished read nobody else waits for is not kept (nor its error)
                if read is not None:
                    self._forget_unwaited_read(request.lora_request.lora_int_id)
        self._enqueue(core_request)

    def _enqueue(self, request: Request) -> None:
        """To the scheduler, or to grammar compilation first for structured outputs."""
        params = request.sampling_params
        if params is None or params.structured_outputs is None:
            self.scheduler.add_request(request)
            return
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.grammar = self._grammar_compiler().submit(params.structured_outputs)
        self._compiling[request.request_id] = request

    def _held_adapters(self) -> set[int]:
        """The LoRA adapters that requests in the engine run under (not to be evicted)."""
        requests = [
            *self.scheduler.requests.values(),
            *self._compiling.values(),
            *(request for request, _ in self._loading.values()),
        ]
        return {r.lora_request.lora_int_id for r in requests if r.lora_request is not None}

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.runner.sampler is None:
            raise ValueError("structured outputs need a model that generates")
        if self._grammars is None:
            eos = self.capabilities.eos_token_id
            self._grammars = GrammarCompiler(
                self.config.model,
                self.config.model.vocab_size,
                eos if isinstance(eos, int | list) else None,  # configs may list several
            )
        return self._grammars

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand requests whose grammar compiled to the scheduler; refuse those that failed."""
        refused = []
        for request_id, request in list(self._compiling.items()):
            grammar = request.grammar
            assert grammar is not None  # only structured requests wait here
            if not grammar.ready:
                continue
            del self._compiling[request_id]
            error = grammar.error()
            if error is not None:
                refused.append(refused_output(request_id, ValueError(error)))
                continue
            self.scheduler.add_request(request)
        return refused

    def _admit_waiting(self) -> list[EngineCoreOutput]:
        """Adapters read first: their requests may go on to grammar compilation."""
        refused = self._admit_loaded() if self._loading else []
        return refused + (self._admit_compiled() if self._compiling else [])

    def _admit_loaded(self) -> list[EngineCoreOutput]:
        """Place the adapters whose folders were read (between steps, so no step sees a
        half-written adapter) and pass their requests on; refuse those whose read or placement
        failed, with the error ``activate`` gives."""
        refused = []
        for request_id, (request, read) in list(self._loading.items()):
            if not read.done():
                continue
            del self._loading[request_id]
            assert request.lora_request is not None  # only adapter requests wait here
            try:
                self.runner.lora.activate(request.lora_request, self._held_adapters())
                self._enqueue(request)
            except Exception as e:
                refused.append(refused_output(request_id, e))
            self._forget_unwaited_read(request.lora_request.lora_int_id)
        return refused

    def _forget_unwaited_read(self, lora_int_id: int) -> None:
        waiting = (r.lora_request for r, _ in self._loading.values())
        if all(lora is None or lora.lora_int_id != lora_int_id for lora in waiting):
            self.runner.lora.forget_read(lora_int_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            parked = self._loading.pop(request_id, None)
            if parked is not None and parked[0].lora_request is not None:
                self._forget_unwaited_read(parked[0].lora_request.lora_int_id)
            request = self._compiling.pop(request_id, None)
            if request is not None and request.grammar is not None:
                request.grammar.future.cancel()
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests() or bool(self._compiling) or bool(self._loading)
        )

    def step(self) -> EngineCoreOutputs:
        """schedule -> execute -> update. A step that raises fails only its own requests (each
        gets an error output naming the cause, its blocks are freed) and the engine goes on;
        ``_MAX_CONSECUTIVE_STEP_FAILURES`` failed steps in a row mean the core itself is broken,
        and the exception propagates."""
        # 0) requests whose adapter was read or grammar compiled join the queue (none running:
        # wait a moment)
        refused = self._admit_waiting()
        if (self._compiling or self._loading) and not self.scheduler.has_unfinished_requests():
            pending: list[Future[Any]] = [read for _, read in self._loading.values()]
            pending += [r.grammar.future for r in self._compiling.values() if r.grammar]
            wait(pending, timeout=_GRAMMAR_WAIT_SECONDS, return_when=FIRST_COMPLETED)
            refused += self._admit_waiting()
        # 1) schedule
        started = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        try:
            # 2) execute
            runner_output = self.runner.execute(scheduler_output)
            # 3) update
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            self._consecutive_failures = 0
            self.scheduler.record_step_time(
                scheduler_output.total_num_scheduled_tokens, time.monotonic() - started
            )
        except Exception as e:
            self._consecutive_failures += 1
            if self._consecutive_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            outputs = self._fail_step(scheduler_output, e)
        return EngineCoreOutputs(
            outputs=refused + outputs,
            stats=self._stats(scheduler_output.total_num_scheduled_tokens),
        )

    def _fail_step(
        self, scheduler_output: SchedulerOutput, error: Exception
    ) -> list[EngineCoreOutput]:
        """Finish every request of a failed step with an error output."""
        request_ids = [s.request_id for s in scheduler_output.scheduled]
        logger.exception("step failed for requests %s", request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        cause = RequestError("failed", f"{type(error).__name__}: {error}")
        return [
            EngineCoreOutput(request_id=request_id, finish_reason="error", error=cause)
            for request_id in request_ids
        ]

    def _stats(self, num_scheduled_tokens: int) -> SchedulerStats:
        manager = self.kv_cache_manager
        num_drafted, num_accepted = self.scheduler.take_spec_decode_counts()
        return SchedulerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + len(self._compiling) + len(self._loading),
            num_scheduled_tokens=num_scheduled_tokens,
            kv_cache_usage=manager.usage if manager is not None else 0.0,
            prefix_cache_queries=manager.queries if manager is not None else 0,
            prefix_cache_hits=manager.hits if manager is not None else 0,
            num_draft_tokens=num_drafted,
            num_accepted_tokens=num_accepted,
        )


# glibc's mallopt parameters (malloc.h) and the values keep_step_memory sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_STEP_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts
_STEP_TRIM_THRESHOLD = 1 << 30


def keep_step_memory() -> bool:
    """Have glibc keep the memory one step frees for the next step; returns whether it took.

    By default glibc serves an allocation above a threshold (which adapts, up to 32 MiB) with
    fresh pages from the OS, and gives the top of its heap back as soon as more than twice that
    threshold is free there. A step of a large batch frees about as much as it allocated (a
    MiniLM step of 8,192 tokens: ~100 MB of activations, the largest 25 MB), so every step
    faulted its activations in again. Fixed thresholds (allocations up to 32 MiB from the heap,
    freed heap memory given back only beyond 1 GiB) keep a step's working set mapped; the
    resident set then stays at its peak instead of returning to it every step (fewer page faults,
    faster passes: docs/performance.md, "numbers out of code comments"). Called once the model
    and the KV cache are allocated (loading and its peak are unchanged); a no-op where the C library is not glibc or CENOTE_KEEP_STEP_MEMORY=0."""
    if os.environ.get("CENOTE_KEEP_STEP_MEMORY") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _STEP_MMAP_THRESHOLD)
        and mallopt(_M_TRIM_THRESHOLD, _STEP_TRIM_THRESHOLD)
    )


def refused_output(request_id: str, error: Exception) -> EngineCoreOutput:
    """The output of a request the core would not add: a ``ValueError`` is about the request
    as given (the client's to fix), anything else is a failure of the core."""
    if isinstance(error, ValueError):
        cause = RequestError("refused", str(error))
    else:
        cause = RequestError("failed", f"{type(error).__name__}: {error}")
    return EngineCoreOutput(request_id=request_id, finish_reason="error", error=cause)


def _label_names(hf_config: dict[str, Any], num_labels: int | None) -> tuple[str, ...] | None:
    """id2label names in id order; transformers' ``LABEL_<i>`` when the config has none."""
    if num_labels is None or hf_config.get("classifier_from_token"):
        return None  # converted LM: the causal config's labels mean nothing
    labels = hf_config.get("id2label") or {str(i): f"LABEL_{i}" for i in range(num_labels)}
    if len(labels) != num_labels:
        return None
    return tuple(str(labels.get(str(i), labels.get(i, i))) for i in range(num_labels))


def _score_type(hf_config: dict[str, Any], tasks: tuple[str, ...]) -> ScoreType | None:
    """How ``score`` works for this model: a classifier scores pairs (cross-encoder); an
    embedding model compares embeddings (cosine), or token embeddings (MaxSim) when the config
    says ``score_type: late_interaction`` or it only embeds tokens."""
    if "classify" in tasks:
        return "cross_encoder"
    if hf_config.get("score_type") == "late_interaction" or (
        "token_embed" in tasks and "embed" not in tasks
    ):
        return "late_interaction"
    if "embed" in tasks:
        return "bi_encoder"
    if "embed_sparse" in tasks:
        return "sparse"
    return None


def _check_kv_cache_fits(
    config: EngineConfig, num_blocks: int, bytes_per_block: int, sliding_window: int | None
) -> None:
    """Refuse a KV cache that cannot hold one request of ``max_model_len`` tokens (such a
    request would wait for blocks forever), naming the options that fix it."""
    cache, max_model_len = config.cache, config.model.max_model_len
    chunk = config.scheduler.max_num_batched_tokens

    def blocks_for(num_tokens: int) -> int:
        return num_blocks_per_request(num_tokens, cache.block_size, sliding_window, chunk)

    num_needed = blocks_for(max_model_len)
    if num_blocks >= num_needed:
        return
    longest, high = 0, max_model_len  # the longest max_model_len this cache serves
    while longest < high:
        middle = (longest + high + 1) // 2
        longest, high = (
            (middle, high) if blocks_for(middle) <= num_blocks else (longest, middle - 1)
        )
    if cache.num_gpu_blocks_override is not None:
        sized_by = "num_gpu_blocks_override"
        fix = f"raise num_gpu_blocks_override (--num-gpu-blocks-override) to at least {num_needed}"
    elif cache.kv_cache_memory_bytes is None and on_cuda(config):
        sized_by = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
        fix = (
            f"raise gpu_memory_utilization (--gpu-memory-utilization) by "
            f"{_size((num_needed - num_blocks) * bytes_per_block)} of the GPU's memory, or "
            "lower max_num_batched_tokens (--max-num-batched-tokens)"
        )
    else:
        sized_by = (
            f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
            if cache.kv_cache_memory_bytes is not None
            else "the default: a quarter of the available memory, at most 1 GiB"
        )
        fix = (
            f"raise kv_cache_memory_bytes (--kv-cache-memory-bytes) to at least "
            f"{num_needed * bytes_per_block} ({_size(num_needed * bytes_per_block)})"
        )
    if longest > 0:
        fix += f", or lower max_model_len (--max-model-len) to at most {longest}"
    raise ValueError(
        f"the KV cache is too small to serve one request of the model's max_model_len "
        f"({max_model_len} tokens): that needs {num_needed} blocks of {cache.block_size} tokens "
        f"({_size(num_needed * bytes_per_block)}), but the cache has {num_blocks} blocks "
        f"({_size(num_blocks * bytes_per_block)}, from {sized_by}); {fix}"
    )


def on_cuda(config: EngineConfig) -> bool:
    """Whether the engine's model, KV cache and steps live on a CUDA device."""
    return config.model.device == "cuda"


def _size(num_bytes: int) -> str:
    """``1.50 GiB``, ``12.0 MiB``, ``96.0 KiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.{2 if shift == 30 else 1}f} {unit}"
    return f"{num_bytes / 1024:.1f} KiB"
