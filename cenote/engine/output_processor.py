"""Engine-core outputs -> user outputs: incremental detokenization, stop strings, n > 1."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from cenote.errors import RequestFailedError, RequestRejectedError
from cenote.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    LogprobsLists,
    RequestError,
)
from cenote.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
)
from cenote.sampling.detokenizer import (
    IncrementalDetokenizer,
    TokenTexts,
    check_stop_strings,
)
from cenote.sampling_params import SamplingParams


@dataclass
class RequestFailure:
    """A user request the engine finished with an error instead of a result."""

    request_id: str  # the user request id
    error: Exception  # RequestRejectedError (the input's fault) or RequestFailedError (a bug)
    finished: bool = True


def _as_exception(error: RequestError, request_id: str) -> Exception:
    if error.code == "refused":
        return RequestRejectedError(error.message)
    return RequestFailedError(
        f"request {request_id} failed in the engine: {error.message}", request_id
    )


@dataclass
class _Completion:
    """State of one generated sequence (one child of a request with n > 1)."""

    index: int  # which of the parent's n completions
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    """One user request: a pooling request or a generation request with n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_class: type[PoolingOutput] | None  # pooling requests only
    completions: dict[str, _Completion] = field(default_factory=dict)  # by engine request id
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    pooled: PoolingRequestOutput | None = None

    @property
    def finished(self) -> bool:
        if self.output_class is not None:
            return self.pooled is not None
        return all(c.finish_reason is not None for c in self.completions.values())


class OutputProcessor:
    """Runs beside the engine core (same process offline, front process in the server)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # decoded_token of logprobs
        self.states: dict[str, _RequestState] = {}  # by user request id
        self.parent_of: dict[str, str] = {}  # engine request id -> user request id
        self.sampling_params: dict[str, SamplingParams] = {}  # by engine request id

    def add_pooling_request(
        self, request: EngineCoreRequest, prompt: str | None, output_class: type[PoolingOutput]
    ) -> None:
        self.states[request.request_id] = _RequestState(
            request.request_id, prompt, request.prompt_token_ids, output_class
        )
        self.parent_of[request.request_id] = request.request_id

    def add_generation_request(
        self, request_id: str, prompt: str | None, children: list[EngineCoreRequest]
    ) -> None:
        """``children``: one engine request per completion (n of them)."""
        state = _RequestState(request_id, prompt, children[0].prompt_token_ids, None)
        if children[0].sampling_params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        for index, child in enumerate(children):
            params = child.sampling_params
            detokenizer = None
            if params.detokenize:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, child.prompt_token_ids, params.skip_special_tokens
                )
            state.completions[child.request_id] = _Completion(
                index, detokenizer, logprobs=[] if params.logprobs is not None else None
            )
            self.parent_of[child.request_id] = request_id
            self.sampling_params[child.request_id] = params
        self.states[request_id] = state

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput | PoolingRequestOutput | RequestFailure], list[str]]:
        """Returns (updated user outputs, engine request ids to abort because a stop string hit
        or a sibling completion failed). A request the core finished with an error comes back
        as a ``RequestFailure`` (its exception) and is forgotten."""
        updated: dict[str, RequestOutput | PoolingRequestOutput | RequestFailure] = {}
        to_abort: list[str] = []
        for out in outputs:
            user_id = self.parent_of.get(out.request_id)
            if user_id is None:
                continue  # aborted earlier
            if out.error is not None:
                updated[user_id] = RequestFailure(user_id, _as_exception(out.error, user_id))
                to_abort.extend(i for i in self.abort(user_id) if i != out.request_id)
                continue
            state = self.states[user_id]
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if state.output_class is not None:
                state.pooled = PoolingRequestOutput(
                    request_id=user_id,
                    outputs=state.output_class(data=out.pooling_output),
                    prompt_token_ids=state.prompt_token_ids,
                )
                updated[user_id] = state.pooled
            else:
                if self._update_completion(state, out):
                    to_abort.append(out.request_id)
                updated[user_id] = self._request_output(state)
            if state.finished:
                self._forget(user_id)
        return list(updated.values()), to_abort

    def _update_completion(self, state: _RequestState, out: EngineCoreOutput) -> bool:
        """Apply one step to a completion; True when a stop string finished it here."""
        completion = state.completions[out.request_id]
        params = self.sampling_params[out.request_id]
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
            match = check_stop_strings(
                completion.text, len(delta), params.stop, params.include_stop_str_in_output
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

    def _request_output(self, state: _RequestState) -> RequestOutput:
        completions = sorted(state.completions.values(), key=lambda c: c.index)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=c.index,
                    text=c.text,
                    token_ids=list(c.token_ids),
                    cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in completions
            ],
            finished=state.finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
        )

    def abort(self, user_request_id: str) -> list[str]:
        """Forget a user request; returns the engine request ids to abort."""
        state = self.states.get(user_request_id)
        if state is None:
            return []
        ids = list(state.completions) or [user_request_id]
        self._forget(user_request_id)
        return ids

    def _forget(self, user_id: str) -> None:
        state = self.states.pop(user_id)
        for engine_id in list(state.completions) or [user_id]:
            self.parent_of.pop(engine_id, None)
            self.sampling_params.pop(engine_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.states)
