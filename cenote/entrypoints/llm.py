"""The offline API: ``LLM(model).embed(...)`` / ``.encode(...)`` / ``.generate(...)``."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from cenote.engine import scoring
from cenote.engine.chat import render_chat, special_token_variables
from cenote.engine.core import EngineCore
from cenote.engine.input_processor import InputProcessor, PromptType
from cenote.engine.output_processor import OutputProcessor, RequestFailure
from cenote.engine_args import EngineArgs, with_engine_args
from cenote.models.tokenizer import load_chat_template, load_tokenizer
from cenote.outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    SparseEmbeddingOutput,
)
from cenote.pooling_params import PoolingParams
from cenote.sampling_params import SamplingParams
from cenote.tasks import PoolingTask

_TQDM_MIN_REQUESTS = 64  # shorter jobs get no progress bar


class LLM:
    """One engine in this process: generation and pooling on one model.

    ``model=None`` serves the embedded all-MiniLM-L6-v2. ``dtype="auto"`` is bf16 on CPUs with
    native bf16 matmuls (AMX / AVX512-bf16), else fp32.
    """

    @with_engine_args(EngineArgs)
    def __init__(self, model: str | os.PathLike[str] | None = None, **options: Any) -> None:
        """``options`` are ``EngineArgs``' fields (``help(EngineArgs)``, ``cenote serve
        --help``): ``dtype``, ``max_model_len``, ``max_num_batched_tokens``, ``num_threads``...
        An unknown option is a TypeError listing the valid ones. Nothing else in this process
        changes: no environment variable, and torch's thread count only when ``num_threads`` is
        given."""
        self.config = EngineArgs.from_options(model, options).create_engine_config()
        model_config = self.config.model
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(model_config)
        self.input_processor = InputProcessor(
            model_config, self.tokenizer, self.engine.capabilities
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.chat_template = load_chat_template(model_config)
        self._template_tokens = special_token_variables(self.tokenizer, model_config.hf_config)
        self._request_counter = itertools.count()

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self.engine.capabilities.supported_tasks

    # ---- pooling ----------------------------------------------------------------------------

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[EmbeddingOutput]]:
        """One embedding per prompt, in input order."""
        return self._pool(
            prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm, EmbeddingOutput
        )

    def embed_sparse(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        max_active_dims: int | None = None,
        return_tokens: bool = False,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[SparseEmbeddingOutput]]:
        """One sparse (SPLADE) embedding per prompt, in input order: ``outputs.pairs`` are its
        (token id, weight) pairs, largest first; only the ``max_active_dims`` largest when given;
        ``outputs.tokens`` are the vocabulary tokens of those ids when ``return_tokens``."""
        if max_active_dims is not None:
            pooling_params = [
                dataclasses.replace(p, max_active_dims=max_active_dims)
                for p in self._per_prompt(pooling_params, len(_as_list(prompts)), PoolingParams)
            ]
        outputs = self._pool(
            prompts,
            pooling_params,
            "embed_sparse",
            truncate_prompt_tokens,
            use_tqdm,
            SparseEmbeddingOutput,
        )
        if return_tokens:
            for out in outputs:
                out.outputs.tokens = [self.tokenizer.id_to_token(i) for i in out.outputs.token_ids]
        return outputs

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        pooling_task: PoolingTask = "embed",
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """The raw pooler output of ``pooling_task`` per prompt (``outputs.data``)."""
        return self._pool(
            prompts, pooling_params, pooling_task, truncate_prompt_tokens, use_tqdm, PoolingOutput
        )

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[ClassificationOutput]]:
        """Class probabilities per prompt (``outputs.probs``; ``outputs.label_names``)."""
        outputs = self._pool(
            prompts,
            pooling_params,
            "classify",
            truncate_prompt_tokens,
            use_tqdm,
            ClassificationOutput,
        )
        return self._with_labels(outputs)

    def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Reward scores (``outputs.data``): per token (``[num_tokens, num_labels]``, or the STEP
        rows where token == ``step_tag_id``, columns ``returned_token_ids``) on models that
        serve ``token_classify``; else the last-token score (``classify``)."""
        task = "token_classify" if "token_classify" in self.supported_tasks else "classify"
        return self._pool(
            prompts, pooling_params, task, truncate_prompt_tokens, use_tqdm, PoolingOutput
        )

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        max_tokens_per_doc: int | None = None,
        instruction: str | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput[ScoringOutput]]:
        """Relevance of each (text_1, text_2) pair (1 -> 1, 1 -> N, N -> N), in input order.
        Classifiers score pairs as cross-encoders; embedding models compare embeddings (cosine);
        late-interaction models compare token embeddings (MaxSim); sparse (SPLADE) models take
        the dot product of their sparse embeddings."""
        pairs = scoring.pair_texts(text_1, text_2)
        plan = scoring.plan_scores(
            self.input_processor, pairs, truncate_prompt_tokens, max_tokens_per_doc, instruction
        )
        outputs = self._submit_pooling(plan.prompts, plan.params, plan.output_class, use_tqdm)
        return plan.scores(outputs)

    def _with_labels(self, outputs: list[PoolingRequestOutput]) -> list[PoolingRequestOutput]:
        names = self.engine.capabilities.label_names
        if names is not None:
            for out in outputs:
                out.outputs.label_names = names
        return outputs

    def _pool(self, prompts, pooling_params, task, truncate_prompt_tokens, use_tqdm, output_class):
        prompts = _as_list(prompts)
        if not prompts:
            return []
        params_list = self._pooling_params(
            pooling_params, len(prompts), task, truncate_prompt_tokens
        )
        tokenized = self._tokenize_pooling(prompts, params_list)
        return self._submit_pooling(tokenized, params_list, output_class, use_tqdm)

    def _pooling_params(self, pooling_params, count, task, truncate_prompt_tokens):
        """Per-prompt params bound to ``task``, validated before any work is queued."""
        params_list = [
            p.with_task(task) for p in self._per_prompt(pooling_params, count, PoolingParams)
        ]
        if truncate_prompt_tokens is not None:
            params_list = [
                dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in params_list
            ]
        for params in params_list:
            self.input_processor.check_pooling_params(params)
        return params_list

    def _tokenize_pooling(self, prompts, params_list) -> list:
        """Tokenize, one batch per (truncation, side) group."""
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params_list):
            groups.setdefault((p.truncate_prompt_tokens, p.truncation_side), []).append(i)
        tokenized = [None] * len(prompts)
        for (truncate, side), indices in groups.items():
            batch = self.input_processor.tokenize([prompts[i] for i in indices], truncate, side)
            for i, tok in zip(indices, batch, strict=True):
                tokenized[i] = tok
        return tokenized

    def _submit_pooling(self, tokenized, params_list, output_class, use_tqdm) -> list:
        requests = [
            self.input_processor.make_request(self._next_id(), tok, pooling_params=params)
            for tok, params in zip(tokenized, params_list, strict=True)
        ]
        submitted: set[str] = set()
        try:
            for request, tok in zip(requests, tokenized, strict=True):
                self.output_processor.add_pooling_request(request, tok.prompt, output_class)
                submitted.add(request.request_id)
                self.engine.add_request(request)
        except BaseException:
            self._abort(submitted)  # a request the engine refuses leaves none of its batch behind
            raise
        return self._run([r.request_id for r in requests], use_tqdm)

    # ---- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Completions of each prompt, in input order."""
        prompts = _as_list(prompts)
        if not prompts:
            return []
        params_list = self._per_prompt(sampling_params, len(prompts), SamplingParams)
        tokenized = self.input_processor.tokenize(prompts, is_pooling=False)
        for i, (tok, params) in enumerate(zip(tokenized, params_list, strict=True)):
            self.input_processor.check_sampling_params(params, len(tok.prompt_token_ids), i)
        user_ids = []
        try:
            for tok, params in zip(tokenized, params_list, strict=True):
                user_id = self._next_id()
                children = [
                    self.input_processor.make_request(
                        f"{i}_{user_id}" if params.n > 1 else user_id,
                        tok,
                        sampling_params=_child_params(params, i),
                    )
                    for i in range(params.n)
                ]
                self.output_processor.add_generation_request(user_id, tok.prompt, children)
                user_ids.append(user_id)
                for child in children:
                    self.engine.add_request(child)
        except BaseException:
            self._abort(set(user_ids))  # a request the engine refuses leaves none of its batch
            raise
        return self._run(user_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, using the model's chat
        template (or ``chat_template``), rendered in a Jinja sandbox."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template = chat_template or self.chat_template
        prompts = [
            render_chat(template, conversation, add_generation_prompt, **self._template_tokens)
            for conversation in conversations
        ]
        tokenized = self.input_processor.tokenize(
            prompts, add_special_tokens=False, is_pooling=False
        )
        return self.generate(
            [
                {"prompt": p, "prompt_token_ids": t.prompt_token_ids}
                for p, t in zip(prompts, tokenized, strict=True)
            ],
            sampling_params,
            use_tqdm=use_tqdm,
        )

    # ---- the loop ---------------------------------------------------------------------------

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list:
        """Step the engine until every request in ``request_ids`` finished; outputs in that order."""
        pending = set(request_ids)
        finished: dict[str, Any] = {}
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm or len(request_ids) < _TQDM_MIN_REQUESTS,
        )
        try:
            while pending:
                step = self.engine.step()
                outputs, to_abort = self.output_processor.process_outputs(step.outputs)
                if to_abort:
                    self.engine.abort_requests(to_abort)
                for output in outputs:
                    if isinstance(output, RequestFailure):
                        raise output.error
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            self._abort(pending)
            raise
        finally:
            bar.close()
        return [finished[request_id] for request_id in request_ids]

    def _abort(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self.engine.abort_requests(self.output_processor.abort(request_id))

    def _next_id(self) -> str:
        return str(next(self._request_counter))

    @staticmethod
    def _per_prompt(params, count: int, default_class: type) -> list:
        if params is None:
            return [default_class() for _ in range(count)]
        if isinstance(params, default_class):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} parameter sets for {count} prompts")
        return params


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise TypeError(
        f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}"
    )


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n completions; seeded requests get seed + i so completions differ."""
    if params.n == 1:
        return params
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)
