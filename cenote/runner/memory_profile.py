"""The memory one full engine step takes on a GPU, measured before the KV cache is sized.

``--gpu-memory-utilization`` (vLLM's meaning) gives the KV cache what is left of a fraction of
the GPU's memory once the weights, the largest step's activations and the CUDA graphs have
theirs. The largest step is found by running one: a dummy batch of ``max_num_batched_tokens``
prompt tokens split over up to ``max_num_seqs`` requests, each sampled at its end (vLLM's
dummy run), through a throw-away runner over a throw-away KV cache just big enough for it.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from cenote.config import EngineConfig
from cenote.models.interfaces import DecoderModel, Model
from cenote.models.layers.attention import kv_cache_shape
from cenote.pooling.pooler import DispatchPooler
from cenote.runner.model_runner import ModelRunner
from cenote.sampling_params import SamplingParams
from cenote.scheduler.output import ScheduledRequest, SchedulerOutput


def dummy_prompt_lengths(num_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """``num_tokens`` split as evenly as possible over as many requests as the step takes
    (at most ``max_num_seqs`` unless ``max_model_len`` needs more; each at least one token)."""
    num_requests = max(1, min(max_num_seqs, num_tokens))
    num_requests = max(num_requests, -(-num_tokens // max_model_len))
    base, extra = divmod(num_tokens, num_requests)
    return [base + (1 if i < extra else 0) for i in range(num_requests)]


def dummy_step(lengths: list[int], block_size: int) -> SchedulerOutput:
    """Whole prompts of ``lengths`` tokens (token id 0), each in its own KV blocks, each
    sampled at its end."""
    next_block = itertools.count()
    scheduled = []
    for i, length in enumerate(lengths):
        block_ids = [next(next_block) for _ in range(-(-length // block_size))]
        scheduled.append(
            ScheduledRequest(
                request_id=f"profile-{i}",
                token_ids=[0] * length,
                start_position=0,
                block_ids=block_ids,
                prompt_token_ids=[0] * length,
                output_token_ids=[],
                token_type_ids=None,
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
                eos_token_id=None,
                completes_prompt=True,
                needs_sample=True,
            )
        )
    return SchedulerOutput(scheduled=scheduled, total_num_scheduled_tokens=sum(lengths))


def profile_step_peak(
    config: EngineConfig, model: Model, pooler: DispatchPooler | None, baseline_bytes: int
) -> tuple[int, int]:
    """``(peak_bytes, activation_bytes)`` of one largest step on CUDA: the peak of torch's
    allocator over this engine's weights and the step, less ``baseline_bytes`` (what was
    allocated before the engine loaded: other engines of the process) and the throw-away KV
    cache; and the part of it the step added (activations, logits)."""
    assert isinstance(model, DecoderModel)  # only causal models have a KV cache to size
    scheduler, cache = config.scheduler, config.cache
    lengths = dummy_prompt_lengths(
        scheduler.max_num_batched_tokens, scheduler.max_num_seqs, config.model.max_model_len
    )
    step = dummy_step(lengths, cache.block_size)
    num_blocks = sum(len(s.block_ids) for s in step.scheduled)
    shape = kv_cache_shape(num_blocks, cache.block_size, model.num_kv_heads, model.head_dim)
    device = config.model.device
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    kv_caches = [
        torch.empty(shape, dtype=config.model.dtype, device=device) for _ in range(model.num_layers)
    ]
    kv_bytes = sum(t.numel() * t.element_size() for t in kv_caches)
    torch.cuda.reset_peak_memory_stats()
    eager = dataclasses.replace(config, cuda_graphs=False)  # graphs are sized separately
    ModelRunner(eager, model, pooler, kv_caches).execute(step)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - kv_bytes
    del kv_caches
    torch.cuda.empty_cache()
    return peak - baseline_bytes, max(0, peak - before)


def graph_reserve_bytes(config: EngineConfig, activation_bytes: int) -> int:
    """Memory the decode graphs will hold (0 without them): one step's activations of the
    largest graph, ``max_num_seqs`` rows (the smaller sizes share its pool), scaled from the
    profiled step of ``max_num_batched_tokens`` rows, whose logits make it an overestimate."""
    if not config.cuda_graphs:
        return 0
    scheduler = config.scheduler
    ratio = min(1.0, scheduler.max_num_seqs / scheduler.max_num_batched_tokens)
    return int(activation_bytes * ratio)
