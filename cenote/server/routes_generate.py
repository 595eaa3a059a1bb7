"""POST /v1/completions and /v1/chat/completions, streaming (SSE) or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from cenote.assistant.message import AssistantStream, parse_assistant
from cenote.assistant.reasoning import constrain_after_thinking, request_reasoning
from cenote.assistant.tools import ToolPlan, plan_tools
from cenote.engine.input_processor import InputProcessor, ParentRequest
from cenote.engine.output_processor import UserOutput
from cenote.errors import InvalidInputError, UnsupportedTaskError
from cenote.messages import EngineCoreRequest
from cenote.outputs import CompletionOutput, Logprob, RequestOutput, ToolCall
from cenote.sampling_params import RequestOutputKind, SamplingParams
from cenote.server import timing
from cenote.server.body import JSONRoute
from cenote.server.errors import BadRequest, describe_error
from cenote.server.protocol import ChatCompletionRequest, CompletionRequest, _GenerationBody
from cenote.server.responses import ChatCompletionResponse, CompletionResponse, schema
from cenote.server.served_models import get_state
from cenote.server.state import ServerState, new_request_id, with_cancellation

router = APIRouter(route_class=JSONRoute)


@router.post("/v1/completions", responses=schema(CompletionResponse, stream=True))
async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
    state = await get_state(raw_request, body.model, "generate")
    with timing.tokenization():
        job = await state.offload(_job, state, body)  # tokenization off the event loop
    timing.record_request_id(job.id)
    return await job.respond(raw_request)


@router.post("/v1/chat/completions", responses=schema(ChatCompletionResponse, stream=True))
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
    state = await get_state(raw_request, body.model, "generate")
    with timing.tokenization():
        job = await state.offload(_job, state, body)  # template + tokenizer off the event loop
    timing.record_request_id(job.id)
    return await job.respond(raw_request)


def _job(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> _Job:
    """The validated, tokenized job of a (chat) completion request."""
    processor = state.processor()
    _check_request(state, body)
    chat = isinstance(body, ChatCompletionRequest)
    plan = None
    if isinstance(body, ChatCompletionRequest):  # tools: checked, rendered by the template
        plan = _tool_plan(state, processor, body)
        prompts = body.prompts(plan.template_tools() if plan else None)
    else:
        prompts = body.prompts()
    if not chat:
        state.check_prompts(prompts)
    _check_n(state, body, len(prompts))
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    params = body.to_sampling_params(_logit_bias(state, body.logit_bias), kind)
    if plan is not None:  # a forced call's grammar; the format's special tokens kept
        params = plan.sampling_params(params)
    if isinstance(body, ChatCompletionRequest):  # a reasoning model's answer is constrained
        params = constrain_after_thinking(
            params, state.reasoning_format, processor.tokenizer, body.chat_template_kwargs
        )
    if params.max_tokens is not None:  # before tokenizing, when the body says it
        _check_generated_tokens(state, len(prompts) * params.n * params.max_tokens)
    prefix = "chatcmpl" if chat else "cmpl"
    engine_id = new_request_id(prefix)  # the engine's key: never taken from the client
    default_max_tokens = body.default_max_tokens
    if default_max_tokens is None:
        default_max_tokens = state.options.default_max_tokens
    # every engine request is built (and validated) before anything is sent or streamed
    requests = processor.process_batch(
        [f"{engine_id}-{i}" for i in range(len(prompts))], prompts, params,
        priority=body.priority, add_special_tokens=body.add_special_tokens,
        default_max_tokens=default_max_tokens, lora_request=state.check_model(body.model),
    )  # fmt: skip
    state.check_request_tokens(sum(len(r.prompt_token_ids) for r in requests))
    _check_generated_tokens(state, sum(_max_tokens(c) for r in requests for c in r.children))
    if params.prompt_logprobs is not None:  # each prompt token: its own and the top entries
        num_prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        state.check_response_values(
            num_prompt_tokens * (params.prompt_logprobs + 1),
            f"{num_prompt_tokens} prompt tokens x (prompt_logprobs {params.prompt_logprobs} + 1)",
        )
    object_name = "chat.completion" if chat else "text_completion"
    response_id = new_request_id(prefix, body.request_id)
    return _Job(state, body, response_id, object_name, requests, params, plan)


def _tool_plan(
    state: ServerState, processor: InputProcessor, body: ChatCompletionRequest
) -> ToolPlan | None:
    """The request's tools checked against the model's template and tool call format."""
    tools, tool_choice, legacy = body.tool_fields()
    try:
        return plan_tools(
            tools, tool_choice, body.parallel_tool_calls, processor.chat_template,
            state.tool_format, state.tokenizer,
        )  # fmt: skip
    except InvalidInputError as e:
        if legacy and e.param in _LEGACY_FIELDS:  # name the field the client sent
            field = _LEGACY_FIELDS[e.param]
            raise InvalidInputError(f"{field} (as {e.param}): {e}", param=field) from e
        raise


_LEGACY_FIELDS = {"tools": "functions", "tool_choice": "function_call"}


def _check_request(state: ServerState, body: _GenerationBody) -> None:
    """Model, task, and the OpenAI fields cenote does not implement."""
    state.check_model(body.model)
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options applies only when stream is true", "stream_options")
    try:
        state.processor().check_task("generate")
    except UnsupportedTaskError as e:
        raise BadRequest(
            f"{e}: use /v1/embeddings, /pooling, /classify, /score or /rerank", param="model"
        ) from e
    _check_stop(state, body)
    if isinstance(body, CompletionRequest) and body.suffix is not None:
        raise BadRequest("suffix is not supported: cenote does not fill in the middle", "suffix")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.best_of not in (None, body.n):
        raise BadRequest("best_of is not supported beyond n: cenote serves n", param="best_of")


def _check_stop(state: ServerState, body: _GenerationBody) -> None:
    """Stop strings and stop token ids are bounded: each string is matched on every token."""
    limit, char_limit = state.options.max_stop_strings, state.options.max_stop_chars
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stop) > limit:
        raise BadRequest(
            f"stop has {len(stop)} strings, more than this server's limit of {limit} "
            "(--max-stop-strings)",
            param="stop",
        )
    num_chars = sum(len(s) for s in stop)
    if num_chars > char_limit:
        raise BadRequest(
            f"stop strings have {num_chars} characters together, more than this server's limit "
            f"of {char_limit} (--max-stop-chars)",
            param="stop",
        )
    num_ids = len(body.stop_token_ids or [])
    if num_ids > limit:
        raise BadRequest(
            f"stop_token_ids has {num_ids} ids, more than this server's limit of {limit} "
            "(--max-stop-strings)",
            param="stop_token_ids",
        )


def _max_tokens(request: EngineCoreRequest) -> int:
    params = request.sampling_params
    assert params is not None and params.max_tokens is not None, "resolved by the processor"
    return params.max_tokens


def _check_generated_tokens(state: ServerState, num_tokens: int) -> None:
    """One request may not ask for hours of generation: prompts x n x max_tokens is bounded."""
    limit = state.options.max_request_generated_tokens
    if num_tokens > limit:
        raise BadRequest(
            f"the request asks for up to {num_tokens} generated tokens (prompts x n x "
            f"max_tokens), more than this server's limit of {limit} per request "
            "(--max-request-generated-tokens); lower max_tokens or n, or split the request",
            param="max_tokens",
        )


def _check_n(state: ServerState, body: _GenerationBody, num_prompts: int) -> None:
    """``n`` completions of every prompt must fit the server's queues."""
    capacity = state.engine_config.scheduler.max_num_seqs + state.options.max_waiting_requests
    if num_prompts * body.n > capacity:  # could never run: not a 429 to retry
        raise BadRequest(
            f"n={body.n} for {num_prompts} prompt(s) asks for {num_prompts * body.n} "
            f"completions; this server holds at most {capacity} requests at once "
            "(max_num_seqs + max_waiting_requests)",
            param="n",
        )
    state.check_capacity(num_prompts * body.n)


def _logit_bias(state: ServerState, bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``{"token id": bias}`` as ``{id: bias}``: keys are token ids of the vocabulary
    written in ASCII digits, each id once ("05", " 5", "５" are refused, not read as 5)."""
    if not bias:
        return None
    vocab, result = state.model_config.vocab_size, {}
    for key, value in bias.items():
        canonical = key.isascii() and key.isdigit() and str(int(key)) == key
        if not canonical or not 0 <= int(key) < vocab:
            raise BadRequest(
                f"logit_bias key {key!r:.40} is not a token id of the vocabulary (size {vocab}): "
                "keys are ids written in ASCII digits without signs, spaces or leading zeros",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise BadRequest(f"logit_bias values are in [-100, 100], got {value}", "logit_bias")
        result[int(key)] = float(value)
    return result


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": call.function.arguments}}  # fmt: skip


class _Job:
    """One HTTP generation request: its prompts' requests (n completions each), the response
    shape. Streams read DELTA outputs, whole answers FINAL_ONLY ones."""

    def __init__(
        self,
        state: ServerState,
        body: CompletionRequest | ChatCompletionRequest,
        response_id: str,
        object_name: str,
        requests: list[ParentRequest],
        params: SamplingParams,
        plan: ToolPlan | None = None,
    ) -> None:
        self.state = state
        self.body = body
        self.id = response_id  # echoed to the client
        self.object = object_name
        self.requests: list[ParentRequest] = requests
        self.params: SamplingParams = params
        self.chat = isinstance(body, ChatCompletionRequest)
        self.created = int(time.time())
        # the ``model`` echoed: the adapter's name when the body named one (vLLM), else the base
        self.model_name = state.echoed_model(body.model)
        self._offsets: dict[tuple[int, int], int] = {}  # text offset reached per choice
        # chat: how replies are read (thinking, tool calls), and each streamed choice's reader
        self.reasoning = None
        if isinstance(body, ChatCompletionRequest):
            self.reasoning = request_reasoning(state.reasoning_format, body.chat_template_kwargs)
        self.tool_format = plan.format if plan is not None else None
        self.max_tool_calls = plan.max_calls if plan is not None else None
        self._replies: dict[tuple[int, int], AssistantStream] = {}
        self._engine_started: float | None = None  # time.monotonic(): requests sent to the engine
        self._engine_finished: float | None = None  # ... and their last output came back

    async def respond(self, raw_request: Request) -> Response:
        if self.body.stream:
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        response: Response = await self._complete(raw_request=raw_request)
        return response

    # ---- running ----------------------------------------------------------------------------

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every prompt, interleaved as they arrive."""
        started = time.monotonic()
        # (prompt index, an output | the error that ended it | None once it finished)
        queue: asyncio.Queue[tuple[int, UserOutput | Exception | None]] = asyncio.Queue()
        client = self.state.client

        async def pump(index: int, request_id: str) -> None:
            try:
                async for output in client.outputs(request_id):
                    await queue.put((index, output))
                await queue.put((index, None))
            except Exception as e:
                await queue.put((index, e))

        timed: set[int] = set()  # prompts whose time to first token is recorded
        self._engine_started = started
        client.add(self.requests)
        tasks = [asyncio.create_task(pump(i, r.request_id)) for i, r in enumerate(self.requests)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    assert isinstance(item, RequestOutput), (
                        "generation requests give RequestOutputs"
                    )
                    first_token = item.metrics.get("first_token_time")
                    if first_token is not None and index not in timed:
                        timed.add(index)
                        self.state.metrics.ttft.observe(first_token - started)
                    yield index, item
            self._engine_finished = time.monotonic()
        finally:
            for task in tasks:
                task.cancel()
            client.abort([r.request_id for r in self.requests])
            self.state.metrics.e2e.observe(time.monotonic() - started)

    @with_cancellation
    async def _complete(self, raw_request: Request) -> Response:
        final: dict[int, RequestOutput] = {}
        async for index, output in self._outputs():
            final[index] = output
        choices = []
        for index in sorted(final):
            for c in final[index].outputs:
                choices.append(self._choice(index, c, final[index], first=True))
        body = self._envelope(choices)
        body["usage"] = self._usage(final, record=True)
        self._record_timings(final, body["usage"])
        if self.chat:
            body.update(self._prompt_extras(final[0]))
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def _stream(self) -> AsyncIterator[bytes]:
        seen: set[tuple[int, int]] = set()  # choices that had a chunk
        final: dict[int, RequestOutput] = {}  # the last output of each prompt (usage)
        options = self.body.stream_options
        # usage in every chunk only together with include_usage (vLLM)
        continuous = (
            options is not None and options.include_usage and options.continuous_usage_stats
        )
        try:
            if self.chat:
                prompt_tokens = sum(len(r.prompt_token_ids) for r in self.requests)
                start_usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                               "total_tokens": prompt_tokens}  # fmt: skip
                for i in range(len(self.requests) * self.params.n):
                    delta = {"role": "assistant", "content": ""}
                    choice = {"index": i, "delta": delta, "finish_reason": None}
                    yield self._sse([choice], usage=start_usage if continuous else None)
            async for index, output in self._outputs():  # DELTA: what is new, held back
                final[index] = output  # while it could grow into a stop string
                choices = []
                for c in output.outputs:
                    key = (index, c.index)
                    if self.chat:
                        choices.extend(self._chat_deltas(index, c))
                    else:
                        choices.append(self._choice(index, c, output, first=key not in seen))
                    seen.add(key)
                for choice in choices:  # one choice per chunk, as OpenAI and vLLM stream
                    usage = self._usage(final) if continuous else None
                    yield self._sse([choice], chunk=True, usage=usage)
            usage = self._usage(final, record=True)
            self._record_timings(final, usage)  # headers are gone: logs, metrics, traces
            if options is not None and options.include_usage:
                yield self._sse([], chunk=True, usage=usage)
        except Exception as e:  # the status the error would have had before the stream began
            status, message, type_, _ = describe_error(e)
            error = {"message": message, "type": type_, "code": status}
            yield b"data: " + msgspec.json.encode({"error": error}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    # ---- response shapes --------------------------------------------------------------------

    def _choice(
        self, index: int, c: CompletionOutput, output: RequestOutput, first: bool
    ) -> dict[str, Any]:
        """One choice (or a streamed delta of it); ``first``: its first appearance, which
        carries what belongs to the prompt (echo, prompt logprobs and token ids)."""
        choice_index = index * self.params.n + c.index
        text, token_ids, entries = c.text, c.token_ids, c.logprobs
        if self.chat:
            message, finish_reason = self._message(text, c.finish_reason)
            choice: dict[str, Any] = {"index": choice_index, "message": message,
                      "logprobs": None if entries is None else self._chat_logprobs(token_ids, entries),
                      "finish_reason": finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
            if self.body.return_token_ids:
                choice["token_ids"] = list(token_ids)
            return choice
        echo = first and isinstance(self.body, CompletionRequest) and self.body.echo
        logprobs = None
        if entries is not None:
            logprobs = self._completion_logprobs((index, c.index), output, token_ids, entries, echo)
        if echo:  # the prompt as given; token ids as their text, special tokens kept (vLLM)
            prompt = output.prompt
            if prompt is None:
                prompt = self.state.tokenizer.decode(
                    output.prompt_token_ids, skip_special_tokens=False
                )
            text = prompt + text
        choice = {"index": choice_index, "text": text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
        if self.body.return_token_ids:
            choice["token_ids"] = list(token_ids)
        if first:
            choice.update(self._prompt_extras(output))
        return choice

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole reply as OpenAI's message, and its finish reason ("tool_calls" with calls)."""
        if self.reasoning is None and self.tool_format is None:
            return {"role": "assistant", "content": text}, finish_reason
        reply = parse_assistant(
            text, self.reasoning, self.tool_format, max_calls=self.max_tool_calls
        )
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if self.reasoning is not None:
            message["reasoning_content"] = reply.reasoning_content
        if reply.tool_calls:
            message["tool_calls"] = [_tool_call(call) for call in reply.tool_calls]
            finish_reason = "tool_calls"
        return message, finish_reason

    def _chat_deltas(self, index: int, c: CompletionOutput) -> list[dict[str, Any]]:
        """The streamed chunks' choices of one output delta: its reasoning and content, then
        per tool call completed in it a chunk naming it and one with its arguments. Text that
        may be a marker's start is held back; the last chunk carries the finish reason."""
        choice_index = index * self.params.n + c.index
        entries = c.logprobs
        first: dict[str, Any] = {"index": choice_index, "delta": {"content": c.text},
                 "logprobs": None if entries is None else self._chat_logprobs(c.token_ids, entries),
                 "finish_reason": None, "stop_reason": None}  # fmt: skip
        if self.body.return_token_ids:
            first["token_ids"] = list(c.token_ids)
        choices, finish_reason = [first], c.finish_reason
        if self.reasoning is not None or self.tool_format is not None:
            key = (index, c.index)
            reply = self._replies.get(key)
            if reply is None:
                reply = AssistantStream(
                    self.reasoning, self.tool_format, max_calls=self.max_tool_calls
                )
                self._replies[key] = reply
            part = reply.feed(c.text)
            if c.finish_reason is not None:
                rest = reply.finish()
                part.reasoning, part.content = (
                    part.reasoning + rest.reasoning,
                    part.content + rest.content,
                )
                part.tool_calls += rest.tool_calls
                if reply.num_calls:
                    finish_reason = "tool_calls"
            first["delta"] = {
                k: v
                for k, v in (("reasoning_content", part.reasoning), ("content", part.content))
                if v
            }
            if not first["delta"] and entries is None and not self.body.return_token_ids:
                choices = []  # all held back: no chunk
            number = reply.num_calls - len(part.tool_calls)  # the index of the first new call
            for i, call in enumerate(part.tool_calls):
                header = {"index": number + i, "id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": ""}}  # fmt: skip
                arguments = {
                    "index": number + i,
                    "function": {"arguments": call.function.arguments},
                }
                for delta in (header, arguments):
                    choices.append({"index": choice_index, "delta": {"tool_calls": [delta]},
                                    "logprobs": None, "finish_reason": None})  # fmt: skip
        if finish_reason is not None:
            if not choices:
                choices = [{"index": choice_index, "delta": {}, "logprobs": None}]
            choices[-1]["finish_reason"] = finish_reason
            choices[-1]["stop_reason"] = c.stop_reason
        return choices

    def _prompt_extras(self, output: RequestOutput) -> dict[str, Any]:
        """``prompt_logprobs`` and ``prompt_token_ids`` (vLLM's fields): null unless asked."""
        extras: dict[str, Any] = {"prompt_logprobs": None, "prompt_token_ids": None}
        if self.body.prompt_logprobs is not None and output.prompt_logprobs is not None:
            extras["prompt_logprobs"] = [
                None if entry is None else {
                    str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": lp.decoded_token}
                    for token_id, lp in list(entry.items())[: self.body.prompt_logprobs + 1]
                }
                for entry in output.prompt_logprobs
            ]  # fmt: skip
        if self.body.return_token_ids:
            extras["prompt_token_ids"] = list(output.prompt_token_ids)
        return extras

    def _chat_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob]]
    ) -> dict[str, Any]:
        top_k = self.params.logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            chosen = entry[token_id]
            top = sorted(entry.values(), key=lambda lp: lp.rank or 0)[:top_k]
            content.append(
                {"token": chosen.decoded_token, "logprob": chosen.logprob,
                 "bytes": list((chosen.decoded_token or "").encode()),
                 "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                   "bytes": list((lp.decoded_token or "").encode())}
                                  for lp in top]}
            )  # fmt: skip
        return {"content": content}

    def _completion_logprobs(
        self,
        key: tuple[int, int],
        output: RequestOutput,
        token_ids: list[int],
        entries: list[dict[int, Logprob]],
        echo: bool,
    ) -> dict[str, Any]:
        """OpenAI's legacy shape. ``top_logprobs`` holds the sampled token and the top
        ``logprobs`` (so ``logprobs: 0`` gives the sampled token's); ``text_offset`` counts from
        the start of the choice's text (the prompt's start when echoed)."""
        rows: list[tuple[str, float | None, dict[str | None, float] | None]] = []
        if echo and output.prompt_logprobs is not None:
            for token_id, entry in zip(
                output.prompt_token_ids, output.prompt_logprobs, strict=False
            ):
                if entry is None:  # the first prompt token has no logprob
                    text = self.state.tokenizer.decode([token_id], skip_special_tokens=False)
                    rows.append((text, None, None))
                else:
                    rows.append(self._logprob_row(entry[token_id], entry))
        for token_id, entry in zip(token_ids, entries, strict=False):
            rows.append(self._logprob_row(entry[token_id], entry))
        offsets, position = [], self._offsets.get(key, 0)
        for text, _, _ in rows:
            offsets.append(position)
            position += len(text)
        self._offsets[key] = position
        return {
            "tokens": [text for text, _, _ in rows],
            "token_logprobs": [logprob for _, logprob, _ in rows],
            "top_logprobs": [top for _, _, top in rows],
            "text_offset": offsets,
        }

    def _logprob_row(
        self, chosen: Logprob, entry: dict[int, Logprob]
    ) -> tuple[str, float, dict[str | None, float]]:
        k = self.params.logprobs or 0
        top = {lp.decoded_token: lp.logprob for lp in list(entry.values())[: k + 1]}
        return chosen.decoded_token or "", chosen.logprob, top

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool = False) -> dict[str, Any]:
        object_name = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model_name, "choices": choices}  # fmt: skip

    def _sse(
        self, choices: list[dict[str, Any]], chunk: bool = True, usage: dict[str, int] | None = None
    ) -> bytes:
        body = self._envelope(choices, chunk)
        if usage is not None:
            body["usage"] = usage
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def _record_timings(self, final: dict[int, RequestOutput], usage: dict[str, int]) -> None:
        """The finished request's engine durations and tokens (cenote/server/timing.py)."""
        assert self._engine_started is not None and self._engine_finished is not None
        timing.record_requests(self.requests)
        run = timing.EngineRun(
            self.state.model_name, "generate", self.state.model_config.device,
            self._engine_started, self._engine_finished, usage["completion_tokens"],
        )  # fmt: skip
        timing.record_outputs(
            [final[i].metrics for i in sorted(final)], usage["prompt_tokens"], run
        )

    def _usage(self, final: dict[int, RequestOutput], record: bool = False) -> dict[str, int]:
        """Tokens so far; ``record`` (once, at the end) adds them to the metrics."""
        prompt = sum(len(o.prompt_token_ids) for o in final.values())
        completion = sum(o.num_generated_tokens for o in final.values())
        if record:
            self.state.metrics.prompt_tokens.inc(prompt)
            self.state.metrics.generation_tokens.inc(completion)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip
