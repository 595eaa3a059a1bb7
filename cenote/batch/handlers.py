"""Run parsed batch lines through the offline ``LLM`` and shape their response bodies as the
HTTP routes do. Each line is validated and tokenized on its own (so a bad line fails alone);
then all embedding lines of a chunk run as one ``LLM.embed`` call and all completion / chat lines
as one ``LLM.generate`` call, so the engine sees full batches. Score and rerank lines run one
``LLM.score`` call each."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from cenote.batch.lines import BatchLine, LineError
from cenote.engine.chat import render_chat, special_token_variables
from cenote.engine.input_processor import PromptType, TokenizedPrompt
from cenote.entrypoints.llm import LLM
from cenote.errors import InvalidInputError
from cenote.outputs import RequestOutput
from cenote.pooling_params import PoolingParams
from cenote.sampling_params import SamplingParams
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
SCORE_FIELDS = (("queries", "documents"), ("data_1", "data_2"), ("text_1", "text_2"))


@dataclass
class PoolingTask:
    line: BatchLine
    prompts: list[dict[str, Any]]  # tokenized: {"prompt", "prompt_token_ids"}
    params: PoolingParams


@dataclass
class GenerationTask:
    line: BatchLine
    prompts: list[dict[str, Any]]
    params: SamplingParams


@dataclass
class ScoringTask:
    line: BatchLine


Task = PoolingTask | GenerationTask | ScoringTask


class BatchHandlers:
    """Prepare (validate + tokenize) and run batch lines on one ``LLM``."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.processor = llm.input_processor
        self.model_config = llm.config.model
        self.template_tokens = special_token_variables(llm.tokenizer, self.model_config.hf_config)

    # ---- 1) prepare: every check a route makes, line by line --------------------------------

    def prepare(self, line: BatchLine) -> Task:
        body = line.body
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
        assert isinstance(body, ScoreRequest | RerankRequest)
        if body.use_activation is not None:
            raise LineError(
                f"line {line.number}: use_activation is not supported for scoring by run-batch "
                "(LLM.score applies the model's default activation)"
            )
        return ScoringTask(line)

    def _check_model(self, model: str | None) -> None:
        name = self.model_config.served_model_name
        if model is not None and model != name:
            raise LineError(
                f"the model {model!r} does not exist; this batch runs {name!r}",
                status=404,
                type_="not_found_error",
            )

    def _prepare_embedding(self, line: BatchLine, body: EmbeddingRequest) -> PoolingTask:
        fields = body.model_dump()
        if (
            body.encoding_format not in ("float", "base64")
            or fields.get("embed_dtype") not in (None, "float32")
            or fields.get("endianness") not in (None, "native", "little")
        ):
            raise LineError(
                f"line {line.number}: run-batch writes float32 embeddings as floats or "
                "little-endian base64 (encoding_format float | base64)"
            )
        side = fields.get("truncation_side") or "right"
        params = PoolingParams(
            task="embed", dimensions=body.dimensions, normalize=body.normalize,
            use_activation=body.use_activation, truncate_prompt_tokens=body.truncate_prompt_tokens,
            truncation_side=side,
        )  # fmt: skip
        self.processor.check_pooling_params(params)
        is_chat = body.messages is not None and body.input is None
        if is_chat:
            prompts: list[PromptType] = [self._render(body.messages, False, {})]
        else:
            prompts = _prompts_from(body.input if body.messages is None else None)
        add_special_tokens = fields.get("add_special_tokens")
        if add_special_tokens is None:  # as the server: yes for input, no for messages
            add_special_tokens = not is_chat
        tokenized = self.processor.tokenize(
            prompts, body.truncate_prompt_tokens, side, add_special_tokens=add_special_tokens
        )
        return PoolingTask(line, _as_token_prompts(tokenized), params)

    def _prepare_generation(
        self, line: BatchLine, body: CompletionRequest | ChatCompletionRequest
    ) -> GenerationTask:
        if body.stream:
            raise LineError(f"line {line.number}: stream is not available in a batch file")
        chat = isinstance(body, ChatCompletionRequest)
        if body.model_dump().get("truncate_prompt_tokens") is not None:
            raise LineError(
                f"line {line.number}: truncate_prompt_tokens not supported by run-batch"
            )
        if chat:
            text = self._render(
                body.messages, body.add_generation_prompt, body.chat_template_kwargs or {}
            )
            tokenized = self.processor.tokenize([text], add_special_tokens=False, is_pooling=False)
            max_tokens = body.max_completion_tokens or body.max_tokens
        else:
            tokenized = self.processor.tokenize(_prompts_from(body.prompt), is_pooling=False)
            max_tokens = body.max_tokens
        if not max_tokens:  # the context left after the longest prompt, as the routes do
            longest = max(len(t.prompt_token_ids) for t in tokenized)
            max_tokens = max(self.model_config.max_model_len - longest, 1)
        params = SamplingParams(
            n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            seed=body.seed, max_tokens=max_tokens,
            min_tokens=body.min_tokens, stop=body.stop, stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )  # fmt: skip
        for i, tok in enumerate(tokenized):
            self.processor.check_sampling_params(params, len(tok.prompt_token_ids), i)
        return GenerationTask(line, _as_token_prompts(tokenized), params)

    def _render(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        variables = {**self.template_tokens, **kwargs}
        return render_chat(self.llm.chat_template, messages, add_generation_prompt, **variables)

    # ---- 2) run: one engine call per kind; 3) shape the bodies -------------------------------

    def run_pooling(self, tasks: list[PoolingTask]) -> list[dict[str, Any]]:
        prompts = [p for t in tasks for p in t.prompts]
        params = [t.params for t in tasks for _ in t.prompts]
        outputs = self.llm.embed(prompts, params, use_tqdm=False)
        bodies, start = [], 0
        for task in tasks:
            mine = outputs[start : start + len(task.prompts)]
            start += len(task.prompts)
            bodies.append(self._embedding_body(task.line.body, mine))
        return bodies

    def run_generation(self, tasks: list[GenerationTask]) -> list[dict[str, Any]]:
        prompts = [p for t in tasks for p in t.prompts]
        params = [t.params for t in tasks for _ in t.prompts]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        bodies, start = [], 0
        for task in tasks:
            mine = outputs[start : start + len(task.prompts)]
            start += len(task.prompts)
            bodies.append(self._generation_body(task, mine))
        return bodies

    def run_scoring(self, task: ScoringTask) -> dict[str, Any]:
        body = task.line.body
        if isinstance(body, ScoreRequest):
            text_1, text_2 = _score_texts(body)
        else:
            text_1, text_2 = body.query, body.document_texts
            if not text_2:
                raise InvalidInputError("rerank needs at least one document, got 0")
            if body.top_n is not None and body.top_n < 0:
                raise InvalidInputError(f"top_n must be 0 (all) or positive, got {body.top_n}")
        scores = self.llm.score(
            text_1, text_2, truncate_prompt_tokens=body.truncate_prompt_tokens,
            max_tokens_per_doc=body.max_tokens_per_doc, instruction=body.instruction,
            use_tqdm=False,
        )  # fmt: skip
        if isinstance(body, ScoreRequest):
            data = [
                {"index": i, "object": "score", "score": s.outputs.score}
                for i, s in enumerate(scores)
            ]
            return self._list_body("score", data, num_tokens=None)
        return self._rerank_body(body, text_2, scores)

    def _embedding_body(self, body: EmbeddingRequest, outputs: list) -> dict[str, Any]:
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

    def _list_body(self, prefix: str, data: list[dict], num_tokens: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.model_config.served_model_name, "data": data,
        }  # fmt: skip
        if num_tokens is not None:
            body["usage"] = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
        return body

    def _rerank_body(self, body: RerankRequest, texts: list[str], scores: list) -> dict[str, Any]:
        order = sorted(range(len(texts)), key=lambda i: -scores[i].outputs.score)
        if body.top_n:
            order = order[: body.top_n]
        return_documents = body.return_documents is not False
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i].outputs.score}
            if return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": self.model_config.served_model_name,
            "results": results,
        }

    def _generation_body(self, task: GenerationTask, outputs: list[RequestOutput]) -> dict:
        body, n = task.line.body, task.params.n
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
                else:
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


def _score_texts(body: ScoreRequest) -> tuple[Any, Any]:
    """The one pair of text fields a /v1/score body gives."""
    fields = body.model_dump()
    given = [pair for pair in SCORE_FIELDS if any(fields.get(n) is not None for n in pair)]
    if len(given) != 1 or any(fields.get(n) is None for n in given[0]):
        raise InvalidInputError(
            "pass one pair of fields: queries and documents (or data_1 and data_2, or text_1 "
            "and text_2)"
        )
    return fields[given[0][0]], fields[given[0][1]]


def _is_set(value: Any) -> bool:
    return value not in (None, False, 0, [], {})


def _prompts_from(input_: Any) -> list[PromptType]:
    """Text, texts, token ids or token-id lists (the server's input shapes) as prompts."""
    if input_ is None:
        raise InvalidInputError("pass exactly one of 'input' and 'messages'")
    if isinstance(input_, str):
        prompts: list[PromptType] = [input_]
    elif input_ and all(isinstance(x, int) for x in input_):
        prompts = [{"prompt_token_ids": list(input_)}]
    elif input_ and all(isinstance(x, list) for x in input_):
        prompts = [{"prompt_token_ids": list(ids)} for ids in input_]
    else:
        prompts = list(input_)
    if not prompts:
        raise InvalidInputError("input is empty: pass at least one text or token-id list")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) and not prompt:
            raise InvalidInputError(f"input {i} is an empty string")
    return prompts


def _as_token_prompts(tokenized: list[TokenizedPrompt]) -> list[dict[str, Any]]:
    return [{"prompt": t.prompt, "prompt_token_ids": t.prompt_token_ids} for t in tokenized]
