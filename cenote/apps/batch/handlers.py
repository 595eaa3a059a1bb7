"""Run parsed batch lines through the offline ``LLM``'s input processor and engine client, and
shape their response bodies as the HTTP routes do. A line's body is translated by the same
``protocol`` methods the routes use and processed on its own (so a bad line fails alone); then
all embedding lines of a chunk run together, and all completion / chat lines, so the engine sees
full batches. Score and rerank lines are planned as the routes plan them and run one by one.
Every text is held to ``max_input_chars`` before it is tokenized, as the server holds it, and a
line's texts go through the tokenizer at most ``max_input_chars`` characters at a time."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from cenote.engine.input_processor import InputProcessor, ParentRequest
from cenote.engine.output_processor import UserOutput, outputs_of
from cenote.engine.params_validator import Params
from cenote.engine.scoring import ScoreItem, pair_score_inputs, plan_scores
from cenote.inputs import PromptType
from cenote.llm import LLM
from cenote.outputs import PoolingRequestOutput, RequestOutput
from cenote.server.batch_lines import BatchLine, LineError
from cenote.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)

# request fields the HTTP routes honour that run-batch does not translate: refused when set
UNTRANSLATED = frozenset(
    {
        "logprobs", "top_logprobs", "prompt_logprobs", "logit_bias", "return_token_ids",
        "continue_final_message", "response_format", "best_of", "suffix", "tools",
        "tool_choice", "functions", "function_call",
    }
)  # fmt: skip


@dataclass
class PoolingTask:
    line: BatchLine
    body: EmbeddingRequest  # the line's body
    requests: list[ParentRequest]  # processed: validated and tokenized


@dataclass
class GenerationTask:
    line: BatchLine
    body: CompletionRequest | ChatCompletionRequest
    requests: list[ParentRequest]
    n: int  # completions per prompt


@dataclass
class ScoringTask:
    line: BatchLine
    body: ScoreRequest | RerankRequest
    pairs: list[tuple[ScoreItem, ScoreItem]]  # (query, document), each text checked for length


Task = PoolingTask | GenerationTask | ScoringTask
_BODIES = (EmbeddingRequest, CompletionRequest, ChatCompletionRequest, ScoreRequest, RerankRequest)


class BatchHandlers:
    """Prepare (validate + tokenize) and run batch lines on one ``LLM``; a text of more than
    ``max_input_chars`` characters is refused before it is tokenized."""

    def __init__(self, llm: LLM, max_input_chars: int) -> None:
        self.llm = llm
        own = llm.input_processor
        self.processor = InputProcessor(
            own.model_config, own.tokenizer, own.capabilities, max_input_chars=max_input_chars
        )
        self.max_input_chars = max_input_chars
        self.model_config = llm.config.model

    # ---- 1) prepare: every check a route makes, line by line --------------------------------

    def prepare(self, line: BatchLine) -> Task:
        body = line.body
        assert isinstance(body, _BODIES), f"{type(body).__name__} has no batch handler"
        self._check_model(body.model)
        unsupported = sorted(
            name for name in body.model_fields_set & UNTRANSLATED if _is_set(getattr(body, name))
        )
        if unsupported:
            raise LineError(
                f"line {line.number}: {', '.join(unsupported)} not supported by run-batch "
                "(use cenote serve for them)"
            )
        if isinstance(body, EmbeddingRequest):
            return self._prepare_embedding(line, body)
        if isinstance(body, CompletionRequest | ChatCompletionRequest):
            return self._prepare_generation(line, body)
        return self._prepare_scoring(line, body)

    def _check_model(self, model: str | None) -> None:
        name = self.model_config.served_model_name
        if model is not None and model != name:
            raise LineError(
                f"the model {model!r} does not exist; this batch runs {name!r}",
                status=404,
                type_="not_found_error",
            )

    def _prepare_embedding(self, line: BatchLine, body: EmbeddingRequest) -> PoolingTask:
        if (
            body.encoding_format not in ("float", "base64")
            or body.embed_dtype != "float32"
            or body.endianness not in ("native", "little")
        ):
            raise LineError(
                f"line {line.number}: run-batch writes float32 embeddings as floats or "
                "little-endian base64 (encoding_format float | base64)"
            )
        requests = self._process(
            line, body.prompts(), body.to_pooling_params("embed"),
            add_special_tokens=body.add_special_tokens,
        )  # fmt: skip
        return PoolingTask(line, body, requests)

    def _prepare_generation(
        self, line: BatchLine, body: CompletionRequest | ChatCompletionRequest
    ) -> GenerationTask:
        if body.stream:
            raise LineError(f"line {line.number}: stream is not available in a batch file")
        requests = self._process(
            line, body.prompts(), body.to_sampling_params(),
            add_special_tokens=body.add_special_tokens,
            default_max_tokens=body.default_max_tokens,
        )  # fmt: skip
        return GenerationTask(line, body, requests, body.n)

    def _prepare_scoring(self, line: BatchLine, body: ScoreRequest | RerankRequest) -> ScoringTask:
        inputs_1, inputs_2 = body.inputs()
        pairs = pair_score_inputs(inputs_1, inputs_2)
        names = ("query", "documents") if isinstance(body, RerankRequest) else ("text_1", "text_2")
        limit = self.max_input_chars
        for side, name in enumerate(names):
            for i, pair in enumerate(pairs):
                text = pair[side]
                if isinstance(text, str) and len(text) > limit:
                    raise LineError(
                        f"line {line.number}: {name}[{i}] has {len(text)} characters, "
                        f"more than the limit of {limit} (--max-input-chars)"
                    )
        return ScoringTask(line, body, pairs)

    def _process(
        self, line: BatchLine, prompts: Sequence[PromptType], params: Params, **options: Any
    ) -> list[ParentRequest]:
        """The line's requests, its texts tokenized a group of at most ``max_input_chars``
        characters at a time (so many long texts never sit in the tokenizer together)."""
        ids = _ids(line, len(prompts))
        requests: list[ParentRequest] = []
        for group in _groups(prompts, self.max_input_chars):
            requests += self.processor.process_batch(
                ids[group.start : group.stop], prompts[group.start : group.stop], params,
                indices=group, **options,
            )  # fmt: skip
        return requests

    # ---- 2) run: one engine call per kind; 3) shape the bodies -------------------------------

    def run_pooling(self, tasks: list[PoolingTask]) -> list[dict[str, Any]]:
        return [
            self._embedding_body(task.body, outputs_of(PoolingRequestOutput, outputs))
            for task, outputs in zip(tasks, self._run(tasks), strict=True)
        ]

    def run_generation(self, tasks: list[GenerationTask]) -> list[dict[str, Any]]:
        return [
            self._generation_body(task, outputs_of(RequestOutput, outputs))
            for task, outputs in zip(tasks, self._run(tasks), strict=True)
        ]

    def _run(self, tasks: list[PoolingTask] | list[GenerationTask]) -> list[list[UserOutput]]:
        """Every task's requests in one engine run; each task's outputs."""
        outputs = self.llm.client.run([r for t in tasks for r in t.requests])
        per_task, start = [], 0
        for task in tasks:
            per_task.append(outputs[start : start + len(task.requests)])
            start += len(task.requests)
        return per_task

    def run_scoring(self, task: ScoringTask) -> dict[str, Any]:
        body = task.body
        rerank = isinstance(body, RerankRequest)
        plan = plan_scores(
            self.processor, _ids(task.line, 1)[0], task.pairs,
            body.to_pooling_params(), max_tokens_per_doc=body.max_tokens_per_doc,
            instruction=body.instruction, fit_documents=rerank,
        )  # fmt: skip
        scores = plan.scores(outputs_of(PoolingRequestOutput, self.llm.client.run(plan.requests)))
        if isinstance(body, RerankRequest):
            return self._rerank_body(body, scores)
        data = [
            {"index": i, "object": "score", "score": s.outputs.score} for i, s in enumerate(scores)
        ]
        return self._list_body("score", data, num_tokens=None)

    def _embedding_body(
        self, body: EmbeddingRequest, outputs: list[PoolingRequestOutput[Any]]
    ) -> dict[str, Any]:
        import base64

        data = []
        for i, out in enumerate(outputs):
            vector = out.outputs.data.float()
            if body.encoding_format == "base64":
                encoded: Any = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
            else:
                encoded = vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": encoded})
        num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return self._list_body("embd", data, num_tokens)

    def _list_body(
        self, prefix: str, data: list[dict[str, Any]], num_tokens: int | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.model_config.served_model_name, "data": data,
        }  # fmt: skip
        if num_tokens is not None:
            body["usage"] = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
        return body

    def _rerank_body(
        self, body: RerankRequest, scores: list[PoolingRequestOutput[Any]]
    ) -> dict[str, Any]:
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": self.model_config.served_model_name,
            "results": body.results([s.outputs.score for s in scores], return_documents=True),
        }

    def _generation_body(
        self, task: GenerationTask, outputs: list[RequestOutput]
    ) -> dict[str, Any]:
        body, n = task.body, task.n
        chat = isinstance(body, ChatCompletionRequest)
        choices = []
        for index, output in enumerate(outputs):
            for c in output.outputs:
                choice: dict[str, Any] = {
                    "index": index * n + c.index,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                }
                if chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                elif isinstance(body, CompletionRequest):
                    echo = (output.prompt or "") if body.echo else ""
                    choice.update(text=echo + c.text, stop_reason=c.stop_reason)
                choices.append(choice)
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        prefix, name = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}", "object": name, "created": int(time.time()),
            "model": self.model_config.served_model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion},
        }  # fmt: skip


def _is_set(value: Any) -> bool:
    return value not in (None, False, 0, [], {})


def _ids(line: BatchLine, count: int) -> list[str]:
    return [f"batch-{line.number}-{i}" for i in range(count)]


def _groups(prompts: Sequence[PromptType], max_chars: int) -> Iterator[range]:
    """Consecutive prompts of at most ``max_chars`` characters of text together (a longer text
    alone: the processor refuses it unread)."""
    start = num_chars = 0
    for i, prompt in enumerate(prompts):
        size = _num_chars(prompt)
        if i > start and num_chars + size > max_chars:
            yield range(start, i)
            start, num_chars = i, 0
        num_chars += size
    if start < len(prompts):
        yield range(start, len(prompts))


def _num_chars(prompt: PromptType) -> int:
    """Characters of text a prompt hands the tokenizer (token ids: none)."""
    if isinstance(prompt, str):
        return len(prompt)
    text = prompt.get("prompt") if isinstance(prompt, dict) else None
    return len(text) if isinstance(text, str) else 0
