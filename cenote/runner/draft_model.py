"""Draft-model speculation (``method: draft_model``): a second, smaller decoder with a KV cache
of its own proposes each decoding request's next tokens greedily; the target verifies them.

Greedy drafts are a deterministic function of the context, so the verifier's one-hot-``q``
rejection rule (accept ``x`` with probability ``p(x)``, else sample ``p`` without ``x``) keeps the
target's output distribution exactly at any temperature, and greedy output token for token
(spec_decode/verifier.py). The draft's own probabilities are never needed.

Per request the proposer keeps a draft-side ``Request``: the tokens the draft has seen (the
target's, then its own drafts) and how many of them its KV cache holds. Each step:

1) roll back: the cache keeps the target's tokens and the leading drafts the target accepted;
2) catch up: one short prefill per request over the tokens the target added since (its own
   token, and the whole prompt the first time), batched over requests under the token budget;
   the pass that reaches a request's end samples its first draft;
3) draft: ``k - 1`` one-token passes batched over requests (the C++ decode stack's path).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from cenote.config import EngineConfig, LoRAConfig, ModelConfig, SpeculativeConfig
from cenote.kv_cache.manager import KVCacheManager, kv_cache_bytes_per_block
from cenote.models.config_reader import read_model_config
from cenote.models.interfaces import CausalLM, DecoderModel
from cenote.models.layers.attention import kv_cache_shape
from cenote.models.loader import load_model
from cenote.models.registry import get_entry
from cenote.models.tokenizer import load_tokenizer
from cenote.platforms import Platform
from cenote.request import Request
from cenote.runner.model_runner import ModelRunner
from cenote.sampling_params import SamplingParams
from cenote.scheduler.output import ScheduledRequest, SchedulerOutput
from cenote.spec_decode.proposer import DraftQuery

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)  # the draft's argmax


def read_draft_model(
    target: ModelConfig, speculative: SpeculativeConfig, platform: Platform
) -> ModelConfig:
    """The draft's config, read at the edge and checked against the target: a decoder with the
    target's vocabulary size and tokenizer (a draft token id must mean the target's token).
    Raises ValueError naming both sides."""
    assert speculative.model is not None  # SpeculativeConfig: draft_model has a model
    try:
        draft = read_model_config(speculative.model, target.dtype, platform=platform)
    except FileNotFoundError as e:
        raise ValueError(
            f"speculative_config model {speculative.model!r} cannot be read: {e}"
        ) from e
    if not get_entry(draft.architecture).is_causal:
        raise ValueError(
            f"speculative_config model {speculative.model!r} is a {draft.architecture}, which "
            "does not generate; a draft model must be a decoder"
        )
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model {speculative.model!r} has a vocabulary of {draft.vocab_size} "
            f"tokens, the target {target.vocab_size}: a draft must share the target's tokenizer"
        )
    _check_same_tokenizer(target, draft, speculative.model)
    # the draft never needs positions past the target's longest sequence
    return dataclasses.replace(draft, max_model_len=min(draft.max_model_len, target.max_model_len))


def _check_same_tokenizer(target: ModelConfig, draft: ModelConfig, name: str) -> None:
    target_vocab = load_tokenizer(target).get_vocab(with_added_tokens=True)
    draft_vocab = load_tokenizer(draft).get_vocab(with_added_tokens=True)
    if target_vocab == draft_vocab:
        return
    differing = sorted(
        token for token in target_vocab.keys() | draft_vocab.keys()
        if target_vocab.get(token) != draft_vocab.get(token)
    )  # fmt: skip
    example = differing[0]
    raise ValueError(
        f"the draft model {name!r}'s tokenizer differs from the target's: {len(differing)} of "
        f"{len(target_vocab)} target / {len(draft_vocab)} draft tokens have other ids (e.g. "
        f"{example!r}: target {target_vocab.get(example)}, draft {draft_vocab.get(example)})"
    )


class DraftModelProposer:
    """Owns the draft model, its runner, its KV cache (``num_draft_blocks`` blocks, default the
    target's number: the draft then has room for every token the target holds) and each
    drafting request's draft-side state. Runs in the engine core's step, before the target."""

    def __init__(self, config: EngineConfig, num_target_blocks: int) -> None:
        speculative = config.speculative
        assert speculative is not None and speculative.draft_model_config is not None
        draft_config = speculative.draft_model_config
        model = load_model(draft_config, config.platform)
        if not isinstance(model, CausalLM) or not isinstance(model, DecoderModel):
            raise ValueError(
                f"the draft model {speculative.model!r} ({type(model).__name__}) has no LM head "
                "or no KV cache layout"
            )
        cache = dataclasses.replace(config.cache, enable_prefix_caching=False)
        num_blocks = speculative.num_draft_blocks or num_target_blocks
        shape = kv_cache_shape(num_blocks, cache.block_size, model.num_kv_heads, model.head_dim)
        kv_caches = [
            torch.zeros(shape, dtype=draft_config.dtype, device=draft_config.device)
            for _ in range(model.num_layers)
        ]
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache.block_size,
            enable_caching=False,
            sliding_window=model.kv_sliding_window,
        )
        runner_config = dataclasses.replace(
            config, model=draft_config, cache=cache, speculative=None, lora=LoRAConfig(),
            cuda_graphs=False,
        )  # fmt: skip
        self.runner = ModelRunner(runner_config, model, None, kv_caches)
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_model_len = draft_config.max_model_len
        self.sequences: dict[str, _DraftSequence] = {}
        self._released: set[str] = set()  # ids the runner has not been told about yet
        bytes_per_block = kv_cache_bytes_per_block(
            model.num_layers, model.num_kv_heads, model.head_dim, cache.block_size,
            draft_config.dtype,
        )  # fmt: skip
        logger.info(
            "draft model %s: KV cache of %d blocks of %d tokens (%.1f MiB)",
            draft_config.path,
            num_blocks,
            cache.block_size,
            num_blocks * bytes_per_block / (1 << 20),
        )

    def propose_batch(self, queries: list[DraftQuery]) -> list[list[int]]:
        """Up to ``num_tokens`` greedy drafts per query; none for a request whose draft cache
        has no room (drafts never take blocks from other requests) or past ``max_model_len``."""
        drafts: list[list[int]] = [[] for _ in queries]
        active: list[tuple[int, _DraftSequence, int]] = []  # (query index, sequence, k)
        # 1) roll each request back to what the target kept; slots for catch-up and drafts
        for index, query in enumerate(queries):
            # the draft feeds its first k - 1 drafts: positions up to len + k - 2
            k = min(query.num_tokens, self.max_model_len - len(query.token_ids))
            if k <= 0:
                continue
            sequence = self._sync(query)
            request = sequence.request
            num_new = request.num_tokens + k - 1 - request.num_computed_tokens
            if self.kv_cache_manager.allocate_slots(request, num_new) is None:
                continue
            active.append((index, sequence, k))
        if not active:
            return drafts
        # 2) catch up on the target's new tokens; the pass that ends a request drafts its first
        pending = [(index, sequence) for index, sequence, _ in active]
        while pending:
            pending = self._catch_up(pending, drafts)
        # 3) one token at a time for those that want more
        for j in range(1, max(k for _, _, k in active)):
            batch = [(index, sequence) for index, sequence, k in active if k > j]
            scheduled = []
            for index, sequence in batch:
                sequence.request.prompt_token_ids.append(drafts[index][-1])
                scheduled.append(self._scheduled(sequence, 1))
            self._run(scheduled, batch, drafts)
        for index, sequence, _ in active:  # the last draft is seen, not yet in the cache
            sequence.request.prompt_token_ids.append(drafts[index][-1])
        return drafts

    def release(self, request_id: str) -> None:
        """Free the request's draft cache (finished, aborted or preempted)."""
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.kv_cache_manager.free(sequence.request)
            self._released.add(request_id)

    def _sync(self, query: DraftQuery) -> _DraftSequence:
        """The request's draft state, rolled back to the tokens the target kept: its own tokens
        and the leading drafts it accepted (the cache past them is overwritten later)."""
        sequence = self.sequences.get(query.request_id)
        if sequence is None:
            request = Request(query.request_id, query.token_ids, _GREEDY, None)
            sequence = self.sequences[query.request_id] = _DraftSequence(request)
        else:
            seen, target = sequence.request.prompt_token_ids, query.token_ids
            valid = sequence.num_synced
            end = min(len(seen), len(target))
            while valid < end and seen[valid] == target[valid]:
                valid += 1
            request = sequence.request
            # the last token is always fed again: its logits give the first draft (the cache
            # may hold it already, when the target kept fewer drafts than were fed)
            request.num_computed_tokens = min(request.num_computed_tokens, valid, len(target) - 1)
            request.prompt_token_ids = target
        sequence.num_synced = len(query.token_ids)
        return sequence

    def _catch_up(
        self, pending: list[tuple[int, _DraftSequence]], drafts: list[list[int]]
    ) -> list[tuple[int, _DraftSequence]]:
        """One pass of at most ``max_num_batched_tokens`` catch-up tokens; those still behind."""
        budget = self.max_num_batched_tokens
        batch, scheduled, behind = [], [], []
        for index, sequence in pending:
            request = sequence.request
            num_left = request.num_tokens - request.num_computed_tokens
            assert num_left > 0  # _sync leaves the last token to feed
            num_new = min(num_left, budget)
            if num_new <= 0:
                behind.append((index, sequence))
                continue
            budget -= num_new
            scheduled.append(self._scheduled(sequence, num_new))
            if num_new == num_left:
                batch.append((index, sequence))
            else:
                behind.append((index, sequence))
        self._run(scheduled, batch, drafts)
        return behind

    def _scheduled(self, sequence: _DraftSequence, num_new: int) -> ScheduledRequest:
        request = sequence.request
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.prompt_token_ids[start:end],
            start_position=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            prompt_token_ids=[],  # greedy without penalties reads no prompt
            output_token_ids=[],
            token_type_ids=None,
            sampling_params=_GREEDY,
            pooling_params=None,
            eos_token_id=None,
            completes_prompt=False,
            needs_sample=end == request.num_tokens,
        )

    def _run(
        self,
        scheduled: list[ScheduledRequest],
        sampled: list[tuple[int, _DraftSequence]],
        drafts: list[list[int]],
    ) -> None:
        """One draft-model pass; ``sampled``'s requests get their next draft token."""
        released, self._released = self._released, set()
        output = self.runner.execute(
            SchedulerOutput(
                scheduled=scheduled,
                total_num_scheduled_tokens=sum(s.num_tokens for s in scheduled),
                finished_request_ids=released,
            )
        )
        for s in scheduled:
            self.sequences[s.request_id].request.num_computed_tokens += s.num_tokens
        for index, sequence in sampled:
            (token,) = output.sampled_token_ids[sequence.request.request_id]
            drafts[index].append(token)


@dataclasses.dataclass(eq=False)
class _DraftSequence:
    """A drafting request on the draft side."""

    request: Request  # prompt_token_ids: every token seen; num_computed_tokens: in the cache
    num_synced: int = 0  # leading tokens known to be the target's
