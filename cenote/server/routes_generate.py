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
from cenote.server.protocol import ChatCompletionRequest, CompletionRequest, _GenerationBody
from cenote.server.state import ServerState, get_state, new_request_id, with_cancellation

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
    state = get_state(raw_request)
    prompts = state.prompts_from(body.prompt, None, add_generation_prompt=False)
    tokenized = _tokenize(state, body, prompts, add_special_tokens=True)
    params = _sampling_params(state, body, tokenized, body.max_tokens, body.logprobs)
    job = _Job(state, body, "cmpl", "text_completion", tokenized, params, chat=False)
    return await job.respond(raw_request)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
    state = get_state(raw_request)
    state.processor()
    text = state.render_chat(
        body.messages, body.add_generation_prompt, **(body.chat_template_kwargs or {})
    )
    tokenized = _tokenize(state, body, [text], add_special_tokens=False)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = _sampling_params(state, body, tokenized, max_tokens, logprobs)
    job = _Job(state, body, "chatcmpl", "chat.completion", tokenized, params, chat=True)
    return await job.respond(raw_request)


def _tokenize(state: ServerState, body: _GenerationBody, prompts: list, add_special_tokens: bool):
    processor = state.processor()
    state.check_model(body.model)
    state.check_task("generate")
    state.check_capacity(len(prompts) * body.n)
    return processor.tokenize(prompts, add_special_tokens=add_special_tokens, is_pooling=False)


def _sampling_params(
    state: ServerState,
    body: _GenerationBody,
    tokenized: list[TokenizedPrompt],
    max_tokens: int | None,
    logprobs: int | None,
) -> SamplingParams:
    limit = state.model_config.max_model_len
    longest = max(len(t.prompt_token_ids) for t in tokenized)
    params = SamplingParams(
        n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        seed=body.seed, max_tokens=max_tokens or max(limit - longest, 1),
        min_tokens=body.min_tokens, stop=body.stop, stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )  # fmt: skip
    for i, tok in enumerate(tokenized):
        state.processor().check_sampling_params(params, len(tok.prompt_token_ids), i)
    return params


class _Job:
    """One HTTP generation request: its prompts, their n completions, the response shape."""

    def __init__(self, state, body, prefix, object_name, tokenized, params, chat: bool) -> None:
        self.state = state
        self.body = body
        self.id = new_request_id(prefix, body.request_id)
        self.object = object_name
        self.tokenized = tokenized
        self.params = params
        self.chat = chat
        self.created = int(time.time())

    async def respond(self, raw_request: Request) -> Response:
        if self.body.stream:
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return await self._complete(raw_request=raw_request)

    # ---- running ----------------------------------------------------------------------------

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, snapshot) of every prompt, interleaved as they arrive."""
        processor = self.state.processor()
        started = time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, tok: TokenizedPrompt) -> None:
            user_id = f"{self.id}-{index}"
            children = [
                processor.make_request(
                    f"{user_id}-{i}" if self.params.n > 1 else user_id,
                    tok,
                    sampling_params=_child_params(self.params, i),
                    priority=self.body.priority,
                )  # fmt: skip
                for i in range(self.params.n)
            ]
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
                choices.append(self._choice(index, c, final[index], c.text, c.token_ids, 0))
        body = self._envelope(choices)
        body["usage"] = self._usage(final)
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def _stream(self) -> AsyncIterator[bytes]:
        sent_text: dict[tuple[int, int], int] = {}
        sent_tokens: dict[tuple[int, int], int] = {}
        final: dict[int, RequestOutput] = {}
        try:
            if self.chat:
                for i in range(len(self.tokenized) * self.params.n):
                    delta = {"role": "assistant", "content": ""}
                    yield self._sse([{"index": i, "delta": delta, "finish_reason": None}])
            async for index, output in self._outputs():
                final[index] = output
                choices = []
                for c in output.outputs:
                    key = (index, c.index)
                    # hold back only a tail that could still grow into a stop string
                    hold = 0 if c.finish_reason else stop_holdback_len(c.text, self.params.stop)
                    end = len(c.text) - hold
                    start, token_start = sent_text.get(key, 0), sent_tokens.get(key, 0)
                    if end <= start and not c.finish_reason:
                        continue
                    text, tokens = c.text[start:end], c.token_ids[token_start:]
                    sent_text[key], sent_tokens[key] = max(end, start), len(c.token_ids)
                    choices.append(self._choice(index, c, output, text, tokens, token_start))
                if choices:
                    yield self._sse(choices, chunk=True)
            usage = self._usage(final)
            options = self.body.stream_options
            if options is not None and options.include_usage:
                yield self._sse([], chunk=True, usage=usage)
        except Exception as e:
            error = {"message": str(e), "type": "internal_server_error", "code": 500}
            yield b"data: " + msgspec.json.encode({"error": error}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    # ---- response shapes --------------------------------------------------------------------

    def _choice(self, index, c: CompletionOutput, output, text, token_ids, token_start) -> dict:
        choice_index = index * self.params.n + c.index
        logprobs = None
        if c.logprobs is not None:
            entries = c.logprobs[token_start : token_start + len(token_ids)]
            logprobs = self._logprobs(token_ids, entries)
        if self.chat:
            key = "delta" if self.body.stream else "message"
            message = (
                {"content": text} if self.body.stream else {"role": "assistant", "content": text}
            )
            return {"index": choice_index, key: message, "logprobs": logprobs,
                    "finish_reason": c.finish_reason}  # fmt: skip
        if self.body.echo and not self.body.stream:
            text = (output.prompt or "") + text
        return {"index": choice_index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}  # fmt: skip

    def _logprobs(self, token_ids: list[int], entries: list[dict]) -> dict:
        top_k = self.params.logprobs or 0
        rows = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            chosen = entry[token_id]
            top = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:top_k]
            rows.append((chosen, top))
        if self.chat:
            return {"content": [
                {"token": chosen.decoded_token, "logprob": chosen.logprob,
                 "bytes": list((chosen.decoded_token or "").encode()),
                 "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                   "bytes": list((lp.decoded_token or "").encode())}
                                  for _, lp in top]}
                for chosen, top in rows
            ]}  # fmt: skip
        offsets, position = [], 0
        for chosen, _ in rows:
            offsets.append(position)
            position += len(chosen.decoded_token or "")
        return {
            "tokens": [chosen.decoded_token for chosen, _ in rows],
            "token_logprobs": [chosen.logprob for chosen, _ in rows],
            "top_logprobs": [{lp.decoded_token: lp.logprob for _, lp in top} for _, top in rows],
            "text_offset": offsets,
        }

    def _envelope(self, choices: list[dict], chunk: bool = False) -> dict[str, Any]:
        object_name = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.state.model_name, "choices": choices}  # fmt: skip

    def _sse(self, choices: list[dict], chunk: bool = True, usage: dict | None = None) -> bytes:
        body = self._envelope(choices, chunk)
        if usage is not None:
            body["usage"] = usage
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def _usage(self, final: dict[int, RequestOutput]) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in final.values())
        completion = sum(len(c.token_ids) for o in final.values() for c in o.outputs)
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
