"""One model runner: builds the flat batch, runs the trunk, then branches once per row."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cenote.config import EngineConfig
from cenote.forward_context import forward_context
from cenote.lora.manager import LoRAManager
from cenote.messages import LogprobsLists, ModelRunnerOutput
from cenote.models.interfaces import CausalLM, DecoderModel, ImageTextModel, Model
from cenote.models.layers.lora import lora_context
from cenote.models.layers.triton_attention import triton_paged_decode
from cenote.pooling.interface import PoolerResult
from cenote.pooling.metadata import PoolingMetadata
from cenote.pooling.pooler import DispatchPooler
from cenote.runner.batch import build_input_batch
from cenote.runner.decode_graphs import DecodeGraphs
from cenote.runner.decode_stack import use_decode_stack
from cenote.sampling.metadata import (
    AllowedTokens,
    SamplingMetadata,
    SamplingRow,
    TokenBias,
    make_generator,
)
from cenote.sampling.sampler import LogprobsTensors, Sampler, compute_prompt_logprobs
from cenote.scheduler.output import ScheduledRequest, SchedulerOutput
from cenote.spec_decode.verifier import verify_drafts
from cenote.structured.grammar import allowed_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Step:
    """One step's trunk pass, as each branch reads it."""

    scheduled: list[ScheduledRequest]  # [num_requests] in batch order
    row_ends: list[int]  # [num_requests] index one past each request's last row
    hidden: torch.Tensor  # [num_tokens, hidden]

    def rows(self, i: int) -> slice:
        """The rows of the ``i``-th request's new tokens."""
        end = self.row_ends[i]
        return slice(end - self.scheduled[i].num_tokens, end)


class ModelRunner:
    """Executes scheduler outputs on one model; holds the KV cache tensors and per-request state
    that lives across steps (seeded generators, logit_bias tensors, hidden states of chunked
    pooling prompts)."""

    def __init__(
        self,
        config: EngineConfig,
        model: Model,
        pooler: DispatchPooler | None,
        kv_caches: list[torch.Tensor] | None,  # per layer [2, blocks, block_size, kv_heads, dim]
    ) -> None:
        self.config = config
        self.model = model
        self.pooler = pooler
        self.kv_caches = kv_caches
        self.device = torch.device(config.model.device)  # the model's: every step tensor's
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        self.lm_head: CausalLM | None = model if isinstance(model, CausalLM) else None
        self.sampler = Sampler() if self.lm_head is not None else None
        self._generators: dict[str, torch.Generator] = {}
        self._logit_biases: dict[str, TokenBias] = {}
        self._partial_hidden: dict[str, list[torch.Tensor]] = {}
        lora = config.lora
        self.lora = LoRAManager(
            model,
            lora.max_loras,
            lora.max_lora_rank,
            config.model.dtype,
            self.device,
            max_cpu_loras=lora.max_cpu_loras,
        )
        if kv_caches is not None:
            use_decode_stack(model, config.platform)  # a decoder's decode steps in one C++ call
        self.decode_graphs: DecodeGraphs | None = None
        if config.cuda_graphs and kv_caches is not None and self.lm_head is not None:
            self.decode_graphs = self._decode_graphs(model, kv_caches)

    def _decode_graphs(self, model: Model, kv_caches: list[torch.Tensor]) -> DecodeGraphs | None:
        """The all-decode graphs of a causal LM on CUDA, or None where decode attention has no
        kernel to read blocks in place (without Triton a graph would gather every row's whole
        table)."""
        if self.device.type == "cuda" and triton_paged_decode() is None:
            logger.info("CUDA graphs off: decode attention needs Triton's paged kernel")
            return None
        assert isinstance(model, DecoderModel)  # a model with a KV cache declares its layout
        num_blocks = kv_caches[0].shape[2]  # the last one is the padding rows' scratch
        return DecodeGraphs(
            model,
            kv_caches,
            block_size=self.block_size,
            max_model_len=self.config.model.max_model_len,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            scratch_block=num_blocks - 1,
            device=self.device,
        )

    def capture_decode_graphs(self) -> None:
        """Capture the all-decode graphs (CUDA; nothing with --enforce-eager or on the CPU).
        A capture that fails (an op of the model that cannot be captured, the graphs' memory)
        leaves the engine eager, with a warning naming the cause, instead of refusing to
        start: graphs are an optimization, and every step also has its eager path."""
        if self.decode_graphs is None:
            return
        try:
            self.decode_graphs.capture()
        except Exception as e:
            logger.warning(
                "CUDA graph capture failed (%s: %s): every step runs eagerly; "
                "--enforce-eager skips the attempt",
                type(e).__name__,
                e,
            )
            self.decode_graphs = None

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # 1) forget requests that finished or were preempted
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
            self._logit_biases.pop(request_id, None)
            self._partial_hidden.pop(request_id, None)
        for request_id in scheduler_output.preempted_request_ids:
            self._partial_hidden.pop(request_id, None)
        output = ModelRunnerOutput()
        if scheduler_output.is_empty:
            return output
        # 2) flat batch -> trunk (all-decode steps: a CUDA graph's replay)
        scheduled = scheduler_output.scheduled
        graphs = self.decode_graphs
        if graphs is not None and graphs.takes(scheduled):
            step = _Step(scheduled, list(range(1, len(scheduled) + 1)), graphs.run(scheduled))
        else:
            step = self._run_eager(scheduled)
        # 3) branch once per row: pool finished prompts, sample at the end of known tokens
        output.pooler_output = self._pool(step)
        if self.sampler is not None:
            self._sample(step, output)
            self._prompt_logprobs(step, output)
        return output

    def _run_eager(self, scheduled: list[ScheduledRequest]) -> _Step:
        if any(s.lora_int_id is not None for s in scheduled):
            # each adapter's rows one run: its update works on slices, no gather / scatter
            scheduled = sorted(scheduled, key=lambda s: s.lora_int_id or 0)
        batch = build_input_batch(
            scheduled, self.block_size, self.kv_caches, self.config.model.max_model_len, self.device
        )
        lora_batch = self.lora.step_batch(
            [s.lora_int_id for s in scheduled], batch.row_ends, [s.num_tokens for s in scheduled]
        )
        with forward_context(batch.attention), lora_context(lora_batch):
            if batch.images is not None:
                assert isinstance(self.model, ImageTextModel)  # the front admits images so
                hidden = self.model(
                    batch.input_ids, batch.positions, batch.token_type_ids, images=batch.images
                )
            else:
                hidden = self.model(batch.input_ids, batch.positions, batch.token_type_ids)
        hidden = hidden[: batch.num_tokens]  # [num_tokens, hidden]: without the padding rows
        return _Step(scheduled, batch.row_ends, hidden)

    # ---- pooling branch ---------------------------------------------------------------------

    def _pool(self, step: _Step) -> dict[str, PoolerResult]:
        rows, params, prompts, start_loc, ids, heads = [], [], [], [0], [], []
        whole_batch = True  # every row of the step is a whole pooled prompt, in order
        for i, s in enumerate(step.scheduled):
            if s.pooling_params is None:
                whole_batch = False
                continue
            chunk = step.hidden[step.rows(i)]  # [num_tokens, hidden]
            if not s.completes_prompt:
                self._partial_hidden.setdefault(s.request_id, []).append(chunk.clone())
                whole_batch = False
                continue
            parts = self._partial_hidden.pop(s.request_id, [])
            whole_batch = whole_batch and not parts
            whole = torch.cat([*parts, chunk]) if parts else chunk  # [rows seen, hidden]
            rows.append(whole)
            params.append(s.pooling_params)
            prompts.append(s.prompt_token_ids[len(s.prompt_token_ids) - whole.shape[0] :])
            start_loc.append(start_loc[-1] + whole.shape[0])
            ids.append(s.request_id)
            heads.append(self.lora.head_score(s.lora_int_id))
        if not ids:
            return {}
        pooled_hidden = step.hidden if whole_batch else torch.cat(rows)
        metadata = PoolingMetadata(
            start_loc=start_loc,
            pooling_params=params,
            prompt_token_ids=prompts,
            head_scores=None if all(head is None for head in heads) else heads,
        )
        assert self.pooler is not None  # the engine admits pooling requests with a pooler only
        results = self.pooler(pooled_hidden, metadata)
        if self.device.type != "cpu":
            results = _to_host(results)
        return dict(zip(ids, results, strict=True))

    # ---- sampling branch --------------------------------------------------------------------

    def _sample(self, step: _Step, output: ModelRunnerOutput) -> None:
        assert self.lm_head is not None and self.sampler is not None  # a CausalLM's runner
        scheduled = step.scheduled
        indices = [i for i, s in enumerate(scheduled) if s.needs_sample]
        drafted = [i for i in indices if scheduled[i].draft_token_ids]
        if drafted:
            self._verify(step, drafted, output)
            indices = [i for i in indices if not scheduled[i].draft_token_ids]
        if not indices:
            return
        last_rows = torch.tensor([step.row_ends[i] - 1 for i in indices], device=self.device)
        logits = self.lm_head.compute_logits(step.hidden[last_rows])  # [num_rows, vocab]
        rows = [self._sampling_row(scheduled[i]) for i in indices]
        metadata = SamplingMetadata.from_rows(rows, self.vocab_size, logits.device)
        constrained = [
            row
            for row, i in enumerate(indices)
            if (grammar := scheduled[i].grammar) is not None and grammar.active
        ]
        if constrained:
            grammars = [scheduled[indices[row]].grammar for row in constrained]
            metadata.allowed = AllowedTokens(
                rows=constrained, words=allowed_tokens([g for g in grammars if g is not None])
            )
        result = self.sampler(logits, metadata)
        sampled = result.sampled_token_ids.tolist()
        for row, i in enumerate(indices):
            s, params = scheduled[i], rows[row].params
            output.sampled_token_ids[s.request_id] = [sampled[row]]
            if result.logprobs is not None and params.logprobs is not None:
                output.logprobs[s.request_id] = _slice_logprobs(
                    result.logprobs, row, row + 1, params.logprobs
                )

    def _verify(self, step: _Step, indices: list[int], output: ModelRunnerOutput) -> None:
        """Requests with draft tokens: logits at each drafted position and the one after,
        verified against the drafts (spec_decode/verifier.py); emits the accepted drafts plus
        the model's own next token."""
        assert self.lm_head is not None and self.sampler is not None  # a CausalLM's runner
        scheduled = step.scheduled
        positions: list[int] = []
        rows: list[SamplingRow] = []
        for i in indices:
            s = scheduled[i]
            num_positions = len(s.draft_token_ids) + 1
            end = step.row_ends[i]
            positions.extend(range(end - num_positions, end))
            rows.extend(self._sampling_row(s, j) for j in range(num_positions))
        index = torch.tensor(positions, device=self.device)
        logits = self.lm_head.compute_logits(step.hidden[index])  # [num_positions, vocab]
        metadata = SamplingMetadata.from_rows(rows, self.vocab_size, logits.device)
        drafts = [scheduled[i].draft_token_ids for i in indices]
        verified = verify_drafts(logits, metadata, drafts, self.sampler.argmax)
        start = 0
        for i, tokens in zip(indices, verified.token_ids, strict=True):
            s = scheduled[i]
            params = s.sampling_params
            assert params is not None  # needs_sample: a generation request
            output.sampled_token_ids[s.request_id] = tokens
            if verified.logprobs is not None and params.logprobs is not None:
                output.logprobs[s.request_id] = _slice_logprobs(
                    verified.logprobs, start, start + len(tokens), params.logprobs
                )
            start += len(s.draft_token_ids) + 1

    def _sampling_row(self, s: ScheduledRequest, num_drafts: int = 0) -> SamplingRow:
        """The request's sampling row; ``num_drafts``: at the position after that many of its
        draft tokens, as if they were output already (penalties, min_tokens)."""
        params = s.sampling_params
        assert params is not None  # needs_sample: a generation request
        generator = None
        if params.seed is not None:
            generator = self._generators.get(s.request_id)
            if generator is None:
                generator = make_generator(params.seed, self.device)
                self._generators[s.request_id] = generator
        output_token_ids = s.output_token_ids
        if num_drafts:
            output_token_ids = output_token_ids + s.draft_token_ids[:num_drafts]
        masked = None
        if len(output_token_ids) < params.min_tokens:
            masked = list(params.stop_token_ids or [])
            if s.eos_token_id is not None:
                masked.append(s.eos_token_id)
        bias = None
        if params.logit_bias:
            bias = self._logit_biases.get(s.request_id)
            if bias is None:
                bias = TokenBias.from_dict(params.logit_bias, self.vocab_size, self.device)
                self._logit_biases[s.request_id] = bias
        return SamplingRow(params, s.prompt_token_ids, output_token_ids, generator, masked, bias)

    def _prompt_logprobs(self, step: _Step, output: ModelRunnerOutput) -> None:
        """Logprobs of each prompt token given the ones before it, for the rows computed now: the
        rows of every request asking for them in one pass (the scheduler bounds their number)."""
        assert self.lm_head is not None  # a CausalLM's runner
        rows: list[torch.Tensor] = []  # per request: its rows of the step's hidden states
        next_ids: list[int] = []  # the prompt token each of those rows predicts
        asked: list[tuple[str, int, int]] = []  # request id, number of rows, top-k
        for i, s in enumerate(step.scheduled):
            params = s.sampling_params
            if params is None or params.prompt_logprobs is None:
                continue
            # positions up to the last one with a next prompt token
            end = min(s.start_position + s.num_tokens, len(s.prompt_token_ids) - 1)
            if end <= s.start_position:
                continue
            start_row = step.rows(i).start
            rows.append(torch.arange(start_row, start_row + end - s.start_position))
            next_ids.extend(s.prompt_token_ids[s.start_position + 1 : end + 1])
            asked.append((s.request_id, end - s.start_position, params.prompt_logprobs))
        if not asked:
            return
        rows_index = torch.cat(rows).to(self.device)
        logits = self.lm_head.compute_logits(step.hidden[rows_index])  # [num_rows, vocab]
        max_k = max(k for _, _, k in asked)
        next_index = torch.tensor(next_ids, device=self.device)
        tensors = compute_prompt_logprobs(logits, next_index, max_k)
        start = 0
        for request_id, num_rows, k in asked:
            output.prompt_logprobs[request_id] = _slice_logprobs(
                tensors, start, start + num_rows, k
            )
            start += num_rows


def _to_host(results: list[PoolerResult]) -> list[PoolerResult]:
    """A step's pooled outputs copied to the host: one copy (one sync) when they are tensors of
    one shape (embeddings, scores), else one each (per-token outputs, multi-task maps)."""
    tensors = [r for r in results if isinstance(r, torch.Tensor)]
    if tensors and len(tensors) == len(results):
        if all(t.shape == tensors[0].shape for t in tensors):
            return list(torch.stack(tensors).cpu().unbind(0))
    return [
        {task: t.cpu() for task, t in r.items()} if isinstance(r, dict) else r.cpu()
        for r in results
    ]


def _slice_logprobs(tensors: LogprobsTensors, start: int, end: int, k: int) -> LogprobsLists:
    return LogprobsLists(
        token_ids=tensors.token_ids[start:end, : k + 1].tolist(),
        logprobs=tensors.logprobs[start:end, : k + 1].tolist(),
        ranks=tensors.ranks[start:end].tolist(),
    )
