"""Engine-core outputs -> user outputs: incremental detokenization, stop strings, n > 1, output
kinds (cumulative, delta, final only)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from tokenizers import Tokenizer

from cenote.engine.chunking import ChunkPlan, join_windows
from cenote.engine.input_processor import ParentRequest
from cenote.errors import RequestFailedError, RequestRejectedError
from cenote.messages import EngineCoreOutput, LogprobsLists, RequestError
from cenote.outputs import (
    ClassificationOutput,
    CompletionOutput,
    EmbeddingOutput,
    Logprob,
    MultiTaskOutput,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
    SparseEmbeddingOutput,
)
from cenote.sampling.detokenizer import IncrementalDetokenizer, TokenTexts
from cenote.sampling.stop_strings import StopStrings, stop_strings
from cenote.sampling_params import RequestOutputKind, SamplingParams
from cenote.tasks import PoolingTaskSelection


@dataclass
class RequestFailure:
    """A user request the engine finished with an error instead of a result."""

    request_id: str  # the user request id
    error: Exception  # RequestRejectedError (the input's fault) or RequestFailedError (a bug)
    finished: bool = True


def as_exception(error: RequestError, request_id: str) -> Exception:
    if error.code == "refused":
        return RequestRejectedError(error.message)
    return RequestFailedError(
        f"request {request_id} failed in the engine: {error.message}", request_id
    )


# the output type of each pooling task (the task travels once: in the params)
POOLING_OUTPUTS: dict[str, type[PoolingOutput]] = {
    "embed": EmbeddingOutput,
    "classify": ClassificationOutput,
    "embed_sparse": SparseEmbeddingOutput,
    "token_embed": PoolingOutput,
    "token_classify": PoolingOutput,
}


@dataclass
class _Completion:
    """State of one generated sequence (one child of a request with n > 1)."""

    index: int  # which of the parent's n completions
    params: SamplingParams  # the child's (its stop strings, output kind)
    detokenizer: IncrementalDetokenizer | None
    stop: StopStrings  # the params' stop strings, matched at once
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # DELTA: tokens (and their logprobs) already in an output
    num_sent_chars: int = 0  # DELTA: characters of ``text`` already in an output
    sent_finish: bool = False  # DELTA: its finish went out


@dataclass
class _RequestState:
    """One user request: a pooling request or a generation request with n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    task: PoolingTaskSelection | None  # the pooling task(s); None: a generation request
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    completions: dict[str, _Completion] = field(default_factory=dict)  # by engine request id
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    pooled: bool = False
    chunks: ChunkPlan | None = None  # a chunked text: how its windows' embeddings join
    window_ids: list[str] = field(default_factory=list)  # its windows' engine request ids
    window_outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # arrived so far
    first_token_time: float | None = None  # time.monotonic() when its first token arrived
    # its engine requests' durations in the core (``RequestOutput.metrics``): the shortest
    # queue wait, and the longest queue + inference (to each one's latest output)
    queue_seconds: float | None = None
    engine_seconds: float = 0.0

    def add_durations(self, out: EngineCoreOutput) -> None:
        if out.queue_seconds is None or out.inference_seconds is None:
            return
        queue = out.queue_seconds
        self.queue_seconds = queue if self.queue_seconds is None else min(self.queue_seconds, queue)
        self.engine_seconds = max(self.engine_seconds, queue + out.inference_seconds)

    def durations(self) -> dict[str, float]:
        """``queue_time`` and ``inference_time`` once an engine request finished, else {}."""
        if self.queue_seconds is None:
            return {}
        inference = max(self.engine_seconds - self.queue_seconds, 0.0)
        return {"queue_time": self.queue_seconds, "inference_time": inference}

    @property
    def finished(self) -> bool:
        if self.task is not None:
            return self.pooled
        return all(c.finish_reason is not None for c in self.completions.values())


UserOutput = RequestOutput | PoolingRequestOutput[Any] | RequestFailure
_T = TypeVar("_T")


def outputs_of(kind: type[_T], outputs: list[UserOutput]) -> list[_T]:
    """``outputs``, each a ``kind`` (requests of one kind; failures were raised earlier)."""
    narrowed: list[_T] = [output for output in outputs if isinstance(output, kind)]
    assert len(narrowed) == len(outputs), f"an output is not a {kind.__name__}"
    return narrowed


class OutputProcessor:
    """Runs beside the engine core (same process offline, front process in the server). Each
    generation request gets the outputs its ``output_kind`` asks for: every update in full
    (CUMULATIVE), what is new (DELTA: text held back while it could still grow into a stop
    string), or only the finished result (FINAL_ONLY: nothing is built before)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # decoded_token of logprobs
        self.label_names: tuple[str, ...] | None = None  # set by the client once it knows them
        self.states: dict[str, _RequestState] = {}  # by user request id
        self.parent_of: dict[str, str] = {}  # engine request id -> user request id

    def add_request(self, request: ParentRequest) -> None:
        """Track a user request (its engine requests: one per completion)."""
        if request.pooling_params is not None:
            state = _RequestState(
                request.request_id, request.prompt, request.prompt_token_ids,
                request.pooling_params.task, chunks=request.chunks,
            )  # fmt: skip
            if request.chunks is not None:
                state.window_ids = [child.request_id for child in request.children]
        else:
            state = self._generation_state(request)
        for child in request.children:
            self.parent_of[child.request_id] = request.request_id
        self.states[request.request_id] = state

    def _generation_state(self, request: ParentRequest) -> _RequestState:
        first = request.children[0].sampling_params
        assert first is not None
        state = _RequestState(
            request.request_id, request.prompt, request.prompt_token_ids, None, first.output_kind
        )
        if first.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        for index, child in enumerate(request.children):
            params = child.sampling_params
            assert params is not None
            detokenizer = None
            if params.detokenize:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, child.prompt_token_ids, params.skip_special_tokens
                )
            state.completions[child.request_id] = _Completion(
                index, params, detokenizer, stop_strings(tuple(params.stop_strings)),
                logprobs=[] if params.logprobs is not None else None,
            )  # fmt: skip
        return state

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[UserOutput], list[str]]:
        """Returns (the user outputs of this step, engine request ids to abort because a stop
        string hit or a sibling completion failed). A request the core finished with an error
        comes back as a ``RequestFailure`` (its exception) and is forgotten."""
        updated: dict[str, _RequestState | UserOutput] = {}
        to_abort: list[str] = []
        for out in outputs:
            user_id = self.parent_of.get(out.request_id)
            if user_id is None:
                continue  # aborted earlier
            if out.error is not None:
                updated[user_id] = RequestFailure(user_id, as_exception(out.error, user_id))
                to_abort.extend(i for i in self.abort(user_id) if i != out.request_id)
                continue
            state = self.states[user_id]
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            state.add_durations(out)
            if state.task is not None:
                pooled: torch.Tensor | dict[str, torch.Tensor] | None = out.pooling_output
                if out.pooling_outputs is not None:  # a multi-task request: never windowed
                    pooled = out.pooling_outputs
                assert pooled is not None, "a finished pooling request has a result"
                if state.chunks is not None:  # a window: join them once all have arrived
                    assert isinstance(pooled, torch.Tensor), "windows pool one task"
                    state.window_outputs[out.request_id] = pooled
                    if len(state.window_outputs) < len(state.window_ids):
                        continue
                    windows = [state.window_outputs[i] for i in state.window_ids]
                    pooled = join_windows(windows, state.chunks)
                state.pooled = True
                updated[user_id] = self._pooling_output(state, pooled)
            else:
                if out.new_token_ids and state.first_token_time is None:
                    state.first_token_time = time.monotonic()
                if self._update_completion(state, out):
                    to_abort.append(out.request_id)
                updated[user_id] = state
            if state.finished:
                self._forget(user_id)
        results = []
        for item in updated.values():
            output = self._request_output(item) if isinstance(item, _RequestState) else item
            if output is not None:
                results.append(output)
        return results, to_abort

    def _pooling_output(
        self, state: _RequestState, pooled: torch.Tensor | dict[str, torch.Tensor]
    ) -> PoolingRequestOutput[Any]:
        result: PoolingOutput | MultiTaskOutput
        if isinstance(pooled, dict):  # a multi-task request: each task's output, in its order
            assert isinstance(state.task, tuple), "a task map answers a multi-task request"
            by_task: dict[str, PoolingOutput] = {
                task: self._task_output(task, pooled[task]) for task in state.task
            }
            result = MultiTaskOutput(by_task)
        else:
            assert not isinstance(state.task, tuple)
            result = self._task_output(state.task or "embed", pooled)
        return PoolingRequestOutput(
            state.request_id, result, state.prompt_token_ids, metrics=state.durations()
        )

    def _task_output(self, task: str, pooled: torch.Tensor) -> PoolingOutput:
        data = POOLING_OUTPUTS[task](data=pooled)
        if isinstance(data, ClassificationOutput):
            data.label_names = self.label_names
        return data

    def _update_completion(self, state: _RequestState, out: EngineCoreOutput) -> bool:
        """Apply one step to a completion; True when a stop string finished it here. Several
        tokens of one step (speculative decoding) are applied one by one where stop strings
        are matched, so no token after the one that completes a stop string is kept."""
        completion = state.completions[out.request_id]
        if len(out.new_token_ids) > 1 and completion.stop.stop and completion.detokenizer:
            for piece in _one_token_outputs(out):
                stopped = self._update_completion_once(state, piece)
                if completion.finish_reason is not None:
                    return stopped
            return False
        return self._update_completion_once(state, out)

    def _update_completion_once(self, state: _RequestState, out: EngineCoreOutput) -> bool:
        completion = state.completions[out.request_id]
        params = completion.params
        if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(self._logprob_dicts(out.new_prompt_logprobs))
        if out.new_logprobs is not None and completion.logprobs is not None:
            entries = self._logprob_dicts(out.new_logprobs)
            completion.logprobs.extend(entries)
            for token_id, entry in zip(out.new_token_ids, entries, strict=False):
                completion.cumulative_logprob += entry[token_id].logprob
        completion.token_ids.extend(out.new_token_ids)
        stopped_by_string = False
        if completion.detokenizer is not None and out.new_token_ids:
            delta = completion.detokenizer.decode_next(out.new_token_ids)
            if out.finish_reason is not None:
                delta += completion.detokenizer.finish()
            completion.text += delta
            match = completion.stop.find(
                completion.text, len(delta), params.include_stop_str_in_output
            )
            if match is not None and completion.finish_reason is None:
                completion.text = completion.text[: match.truncate_to]
                completion.finish_reason, completion.stop_reason = "stop", match.stop_str
                stopped_by_string = out.finish_reason is None
        if completion.finish_reason is None and out.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
        return stopped_by_string

    def _logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        flat_texts = self.token_texts.lookup([t for ids in lists.token_ids for t in ids])
        result, start = [], 0
        for ids, values, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True):
            texts, start = flat_texts[start : start + len(ids)], start + len(ids)
            entry = {}
            row = zip(ids, values, texts, strict=True)
            for position, (token_id, value, text) in enumerate(row):
                if token_id not in entry:
                    entry[token_id] = Logprob(
                        logprob=value, rank=rank if position == 0 else position, decoded_token=text
                    )
            result.append(entry)
        return result

    def _request_output(self, state: _RequestState) -> RequestOutput | None:
        """The output of a generation request after an update, as its output kind asks."""
        kind = state.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        completions = sorted(state.completions.values(), key=lambda c: c.index)
        if kind == RequestOutputKind.DELTA:
            outputs = [d for d in map(_delta, completions) if d is not None]
        else:  # finished state is forgotten: its lists go out as they are
            cumulative = kind == RequestOutputKind.CUMULATIVE
            outputs = [
                CompletionOutput(
                    index=c.index,
                    text=c.text,
                    token_ids=_copy(c.token_ids, cumulative),
                    cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                    logprobs=_copy(c.logprobs, cumulative) if c.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in completions
            ]
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, outputs, state.finished,
            prompt_logprobs=state.prompt_logprobs, num_cached_tokens=state.num_cached_tokens,
            num_generated_tokens=sum(len(c.token_ids) for c in completions),
            metrics=_metrics(state),
        )  # fmt: skip

    def abort(self, user_request_id: str) -> list[str]:
        """Forget a user request; returns the engine request ids to abort."""
        state = self.states.get(user_request_id)
        if state is None:
            return []
        ids = list(state.completions) or state.window_ids or [user_request_id]
        self._forget(user_request_id)
        return ids

    def _forget(self, user_id: str) -> None:
        state = self.states.pop(user_id)
        for engine_id in list(state.completions) or state.window_ids or [user_id]:
            self.parent_of.pop(engine_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.states)


def _metrics(state: _RequestState) -> dict[str, float]:
    """A generation output's metrics: its first token's time; its durations once finished."""
    metrics = state.durations() if state.finished else {}
    if state.first_token_time is not None:
        metrics["first_token_time"] = state.first_token_time
    return metrics


def _copy(items: list[_T], cumulative: bool) -> list[_T]:
    """A copy for CUMULATIVE outputs (the state goes on changing); the list itself otherwise."""
    return list(items) if cumulative else items


def _delta(c: _Completion) -> CompletionOutput | None:
    """What is new in a completion since its last output: text up to the part that could
    still grow into a stop string (all of it once finished), and every token since. None when
    there is no new text and it did not just finish (its tokens wait for the next output)."""
    if c.sent_finish:
        return None
    hold = 0 if c.finish_reason else c.stop.holdback(c.text)
    end = len(c.text) - hold
    if end <= c.num_sent_chars and c.finish_reason is None:
        return None
    start, token_start = c.num_sent_chars, c.num_sent_tokens
    c.num_sent_chars, c.num_sent_tokens = max(end, start), len(c.token_ids)
    c.sent_finish = c.finish_reason is not None
    return CompletionOutput(
        index=c.index,
        text=c.text[start:end],
        token_ids=c.token_ids[token_start:],
        cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
        logprobs=c.logprobs[token_start:] if c.logprobs is not None else None,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


def _one_token_outputs(out: EngineCoreOutput) -> list[EngineCoreOutput]:
    """``out`` as one output per new token: prompt logprobs ride on the first, the finish on
    the last."""
    last = len(out.new_token_ids) - 1
    pieces = []
    for i, token_id in enumerate(out.new_token_ids):
        logprobs = out.new_logprobs
        if logprobs is not None:
            logprobs = LogprobsLists(
                logprobs.token_ids[i : i + 1],
                logprobs.logprobs[i : i + 1],
                logprobs.ranks[i : i + 1],
            )
        pieces.append(
            dataclasses.replace(
                out,
                new_token_ids=[token_id],
                new_logprobs=logprobs,
                new_prompt_logprobs=out.new_prompt_logprobs if i == 0 else None,
                finish_reason=out.finish_reason if i == last else None,
                stop_reason=out.stop_reason if i == last else None,
            )
        )
    return pieces
