"""POST /v1/completions and /v1/chat/completions, streaming (SSE) or not."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from cenote.engine.input_processor import TokenizedPrompt
from cenote.outputs import CompletionOutput, RequestOutput
from cenote.sampling.detokenizer import stop_holdback_len
from cenote.sampling_params import SamplingParams
from cenote.server.body import JSONRoute
from cenote.server.errors import BadRequest
from cenote.server.protocol import ChatCompletionRequest, CompletionRequest, _GenerationBody
from cenote.server.responses import ChatCompletionResponse, CompletionResponse, schema
from cenote.server.state import ServerState, get_state, new_request_id, with_cancellation

router = APIRouter(route_class=JSONRoute)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


@router.post("/v1/completions", responses=schema(CompletionResponse, stream=True))
async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
    state = get_state(raw_request)
    job = await state.offload(_completion_job, state, body)  # tokenization off the event loop
    return await job.respond(raw_request)


def _completion_job(state: ServerState, body: CompletionRequest) -> _Job:
    """The validated, tokenized job of a completion request."""
    _check_request(state, body)
    if body.suffix is not None:
        raise BadRequest("suffix is not supported: cenote does not fill in the middle", "suffix")
    prompts = state.prompts_from(body.prompt, None, add_generation_prompt=False)
    tokenized = _tokenize(state, body, prompts, add_special_tokens=body.add_special_tokens)
    max_tokens = body.max_tokens
    if max_tokens is None:
        room = state.model_config.max_model_len - _longest(tokenized)
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, max(room, 1))
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # echoed prompt tokens carry their logprobs
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    params = _sampling_params(state, body, tokenized, max_tokens, body.logprobs, prompt_logprobs)
    return _Job(state, body, "cmpl", "text_completion", tokenized, params, chat=False)


@router.post("/v1/chat/completions", responses=schema(ChatCompletionResponse, stream=True))
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
    state = get_state(raw_request)
    job = await state.offload(_chat_job, state, body)  # template + tokenizer off the event loop
    return await job.respond(raw_request)


def _chat_job(state: ServerState, body: ChatCompletionRequest) -> _Job:
    """The validated, tokenized job of a chat completion request."""
    _check_request(state, body)
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    text = state.render_chat(
        body.messages, body.add_generation_prompt,
        continue_final_message=body.continue_final_message, **(body.chat_template_kwargs or {}),
    )  # fmt: skip
    tokenized = _tokenize(state, body, [text], add_special_tokens=body.add_special_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    if max_tokens is None:  # the rest of the context, as vLLM
        max_tokens = max(state.model_config.max_model_len - _longest(tokenized), 1)
    params = _sampling_params(state, body, tokenized, max_tokens, logprobs, body.prompt_logprobs)
    return _Job(state, body, "chatcmpl", "chat.completion", tokenized, params, chat=True)


def _check_request(state: ServerState, body: _GenerationBody) -> None:
    """Model, task, the OpenAI fields cenote does not implement, and ``n``."""
    state.processor()
    state.check_model(body.model)
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options applies only when stream is true", "stream_options")
    if "generate" not in state.supported_tasks:
        raise BadRequest(
            f"{state.model_name} does not generate text (task 'generate' is not supported); it "
            f"supports {', '.join(state.supported_tasks)}: use /v1/embeddings, /pooling, "
            "/classify, /score or /rerank",
            param="model",
        )
    unsupported = {
        "tools": bool(body.tools),
        "functions": bool(body.functions),
        "tool_choice": body.tool_choice not in (None, "none"),
        "function_call": body.function_call not in (None, "none"),
        "response_format": (body.response_format or {"type": "text"}).get("type") != "text",
        "best_of": body.best_of not in (None, body.n),
    }
    for field, asked in unsupported.items():
        if asked:
            raise BadRequest(
                f"{field} is not supported: cenote generates plain text (no tool calls, JSON "
                "mode or structured outputs, no best_of beyond n)",
                param=field,
            )


def _tokenize(state: ServerState, body: _GenerationBody, prompts: list, add_special_tokens: bool):
    processor = state.processor()
    state.check_task("generate")
    capacity = state.engine_config.scheduler.max_num_seqs + state.options.max_waiting_requests
    if len(prompts) * body.n > capacity:  # could never run: not a 429 to retry
        raise BadRequest(
            f"n={body.n} for {len(prompts)} prompt(s) asks for {len(prompts) * body.n} "
            f"completions; this server holds at most {capacity} requests at once "
            "(max_num_seqs + max_waiting_requests)",
            param="n",
        )
    state.check_capacity(len(prompts) * body.n)
    tokenized = processor.tokenize(
        prompts, body.truncate_prompt_tokens, body.truncation_side,
        add_special_tokens=add_special_tokens, is_pooling=False,
    )  # fmt: skip
    state.check_request_tokens(sum(len(t.prompt_token_ids) for t in tokenized))
    return tokenized


def _longest(tokenized: list[TokenizedPrompt]) -> int:
    return max(len(t.prompt_token_ids) for t in tokenized)


def _logit_bias(state: ServerState, bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``{"token id": bias}`` as ``{id: bias}``, ids in the vocabulary."""
    if not bias:
        return None
    vocab, result = state.model_config.vocab_size, {}
    for key, value in bias.items():
        if not key.strip().isdigit() or not 0 <= int(key) < vocab:
            raise BadRequest(
                f"logit_bias key {key!r:.40} is not a token id of the vocabulary (size {vocab})",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise BadRequest(f"logit_bias values are in [-100, 100], got {value}", "logit_bias")
        result[int(key)] = float(value)
    return result


def _sampling_params(
    state: ServerState,
    body: _GenerationBody,
    tokenized: list[TokenizedPrompt],
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    params = SamplingParams(
        n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        seed=body.seed, max_tokens=max_tokens,
        min_tokens=body.min_tokens, stop=body.stop, stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias=_logit_bias(state, body.logit_bias),
    )  # fmt: skip
    for i, tok in enumerate(tokenized):
        state.processor().check_sampling_params(params, len(tok.prompt_token_ids), i)
    return params


class _Job:
    """One HTTP generation request: its prompts, their n completions, the response shape."""

    def __init__(self, state, body, prefix, object_name, tokenized, params, chat: bool) -> None:
        self.state = state
        self.body = body
        self.id = new_request_id(prefix, body.request_id)  # echoed to the client
        self.engine_id = new_request_id(prefix)  # the engine's key: never taken from the client
        self.object = object_name
        self.tokenized = tokenized
        self.params = params
        self.chat = chat
        self.created = int(time.time())
        self._offsets: dict[tuple[int, int], int] = {}  # text offset reached per choice
        # every engine request is built (and validated) before anything is sent or streamed
        self.children = [self._children(index, tok) for index, tok in enumerate(tokenized)]

    def _children(self, index: int, tok: TokenizedPrompt) -> tuple[str, list]:
        """The user-level id of prompt ``index`` and its n engine requests."""
        user_id = f"{self.engine_id}-{index}"
        children = [
            self.state.processor().make_request(
                f"{user_id}-{i}" if self.params.n > 1 else user_id,
                tok,
                sampling_params=_child_params(self.params, i),
                priority=self.body.priority,
            )
            for i in range(self.params.n)
        ]
        return user_id, children

    async def respond(self, raw_request: Request) -> Response:
        if self.body.stream:
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return await self._complete(raw_request=raw_request)

    # ---- running ----------------------------------------------------------------------------

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, snapshot) of every prompt, interleaved as they arrive."""
        started = time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, tok: TokenizedPrompt) -> None:
            user_id, children = self.children[index]
            first = True
            try:
                async for output in self.state.client.generate(user_id, tok.prompt, children):
                    if first:
                        self.state.metrics.ttft.observe(time.monotonic() - started)
                        first = False
                    await queue.put((index, output))
                await queue.put((index, None))
            except Exception as e:
                await queue.put((index, e))

        tasks = [asyncio.create_task(pump(i, tok)) for i, tok in enumerate(self.tokenized)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            self.state.metrics.e2e.observe(time.monotonic() - started)

    @with_cancellation
    async def _complete(self, raw_request: Request) -> Response:
        final: dict[int, RequestOutput] = {}
        async for index, output in self._outputs():
            final[index] = output
        choices = []
        for index in sorted(final):
            for c in final[index].outputs:
                choices.append(self._choice(index, c, final[index], c.text, c.token_ids, 0, True))
        body = self._envelope(choices)
        body["usage"] = self._usage(final, record=True)
        if self.chat:
            body.update(self._prompt_extras(final[0]))
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def _stream(self) -> AsyncIterator[bytes]:
        sent_text: dict[tuple[int, int], int] = {}
        sent_tokens: dict[tuple[int, int], int] = {}
        finished: set[tuple[int, int]] = set()  # choices whose finish_reason went out
        final: dict[int, RequestOutput] = {}
        options = self.body.stream_options
        # usage in every chunk only together with include_usage (vLLM)
        continuous = (
            options is not None and options.include_usage and options.continuous_usage_stats
        )
        try:
            if self.chat:
                prompt_tokens = sum(len(t.prompt_token_ids) for t in self.tokenized)
                start_usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                               "total_tokens": prompt_tokens}  # fmt: skip
                for i in range(len(self.tokenized) * self.params.n):
                    delta = {"role": "assistant", "content": ""}
                    choice = {"index": i, "delta": delta, "finish_reason": None}
                    yield self._sse([choice], usage=start_usage if continuous else None)
            async for index, output in self._outputs():
                final[index] = output
                choices = []
                for c in output.outputs:
                    key = (index, c.index)
                    if key in finished:
                        continue
                    # hold back only a tail that could still grow into a stop string
                    hold = 0 if c.finish_reason else stop_holdback_len(c.text, self.params.stop)
                    end = len(c.text) - hold
                    start, token_start = sent_text.get(key, 0), sent_tokens.get(key, 0)
                    if end <= start and not c.finish_reason:
                        continue
                    text, tokens = c.text[start:end], c.token_ids[token_start:]
                    first = key not in sent_text
                    sent_text[key], sent_tokens[key] = max(end, start), len(c.token_ids)
                    if c.finish_reason:
                        finished.add(key)
                    choices.append(self._choice(index, c, output, text, tokens, token_start, first))
                for choice in choices:  # one choice per chunk, as OpenAI and vLLM stream
                    usage = self._usage(final) if continuous else None
                    yield self._sse([choice], chunk=True, usage=usage)
            usage = self._usage(final, record=True)
            if options is not None and options.include_usage:
                yield self._sse([], chunk=True, usage=usage)
        except Exception as e:
            error = {"message": str(e), "type": "internal_server_error", "code": 500}
            yield b"data: " + msgspec.json.encode({"error": error}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    # ---- response shapes --------------------------------------------------------------------

    def _choice(
        self, index, c: CompletionOutput, output: RequestOutput, text, token_ids, token_start,
        first: bool,
    ) -> dict:  # fmt: skip
        """One choice (or a streamed delta of it); ``first``: its first appearance, which
        carries what belongs to the prompt (echo, prompt logprobs and token ids)."""
        choice_index = index * self.params.n + c.index
        entries = None
        if c.logprobs is not None:
            entries = c.logprobs[token_start : token_start + len(token_ids)]
        if self.chat:
            key = "delta" if self.body.stream else "message"
            message = (
                {"content": text} if self.body.stream else {"role": "assistant", "content": text}
            )
            choice = {"index": choice_index, key: message,
                      "logprobs": None if entries is None else self._chat_logprobs(token_ids, entries),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip
            if self.body.return_token_ids:
                choice["token_ids"] = list(token_ids)
            return choice
        echo = first and self.body.echo
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

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict]) -> dict:
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
        self, key, output: RequestOutput, token_ids: list[int], entries: list[dict], echo: bool
    ) -> dict:
        """OpenAI's legacy shape. ``top_logprobs`` holds the sampled token and the top
        ``logprobs`` (so ``logprobs: 0`` gives the sampled token's); ``text_offset`` counts from
        the start of the choice's text (the prompt's start when echoed)."""
        rows: list[tuple[str, float | None, dict | None]] = []
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

    def _logprob_row(self, chosen, entry: dict) -> tuple[str, float, dict]:
        k = self.params.logprobs or 0
        top = {lp.decoded_token: lp.logprob for lp in list(entry.values())[: k + 1]}
        return chosen.decoded_token or "", chosen.logprob, top

    def _envelope(self, choices: list[dict], chunk: bool = False) -> dict[str, Any]:
        object_name = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.state.model_name, "choices": choices}  # fmt: skip

    def _sse(self, choices: list[dict], chunk: bool = True, usage: dict | None = None) -> bytes:
        body = self._envelope(choices, chunk)
        if usage is not None:
            body["usage"] = usage
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def _usage(self, final: dict[int, RequestOutput], record: bool = False) -> dict[str, int]:
        """Tokens so far; ``record`` (once, at the end) adds them to the metrics."""
        prompt = sum(len(o.prompt_token_ids) for o in final.values())
        completion = sum(len(c.token_ids) for o in final.values() for c in o.outputs)
        if record:
            self.state.metrics.prompt_tokens.inc(prompt)
            self.state.metrics.generation_tokens.inc(completion)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n completions; seeded requests get seed + i so completions differ."""
    if params.n == 1:
        return params
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)
