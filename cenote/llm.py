"""The offline API: ``LLM(model).embed(...)`` / ``.encode(...)`` / ``.generate(...)``, and the
params and output classes it takes and returns (``__all__``: what ``cenote`` exports)."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypedDict, TypeVar, Unpack, cast, overload

from cenote.assistant.message import parse_assistant
from cenote.assistant.reasoning import (
    constrain_after_thinking,
    reasoning_format,
    request_reasoning,
)
from cenote.assistant.tool_parsers import tool_call_format
from cenote.assistant.tools import plan_tools
from cenote.engine import scoring
from cenote.engine.client import InProcessClient
from cenote.engine.core import EngineCore
from cenote.engine.heap import old_objects_set_aside
from cenote.engine.input_processor import (
    InputProcessor,
    ParentRequest,
    per_prompt,
    per_prompt_adapters,
)
from cenote.engine.output_processor import UserOutput, outputs_of
from cenote.engine.params_validator import Params
from cenote.engine.scoring import ScoreItem
from cenote.engine_args import EngineArgs, with_engine_args
from cenote.errors import InvalidInputError, InvalidInputTypeError
from cenote.images.sources import MediaPolicy
from cenote.inputs import ChatPrompt, PromptType, TextRole
from cenote.lora_request import LoRARequest
from cenote.models.tokenizer import load_tokenizer
from cenote.outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    MultiTaskOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    SparseEmbeddingOutput,
    SpecDecodeMetrics,
)
from cenote.pooling_params import PoolingParams
from cenote.sampling_params import RequestOutputKind, SamplingParams
from cenote.structured.params import StructuredOutputsParams
from cenote.tasks import PoolingTask, PoolingTaskSelection

__all__ = [
    "LLM",
    "LoRARequest",
    "PoolingParams",
    "StructuredOutputsParams",
    "SamplingParams",
    "RequestOutput",
    "PoolingRequestOutput",
    "ClassificationOutput",
    "EmbeddingOutput",
    "MultiTaskOutput",
    "PoolingOutput",
    "ScoringOutput",
    "SparseEmbeddingOutput",
    "SpecDecodeMetrics",
]

_Output = TypeVar("_Output", bound=PoolingOutput | MultiTaskOutput)
# prompts made (tokenized) at once when made beside the steps (off the CPU): 8,192 short texts
# are 8 parts, the first one's tokenization the only one not behind a step
_INPUT_PART = 1024


def _made_beside_steps(device: str, num_prompts: int) -> bool:
    """Whether ``num_prompts`` prompts are made (tokenized) in parts beside the steps: off the
    CPU, where the host's cores are free while the device computes, and for at least two
    parts. On the CPU those cores are the compute, and the parts would only take turns."""
    return device != "cpu" and num_prompts >= 2 * _INPUT_PART


_Params = TypeVar("_Params", SamplingParams, PoolingParams)

Prompts = PromptType | Sequence[PromptType]  # one prompt or a list (``cenote.inputs``)
PoolingParamsArg = PoolingParams | Sequence[PoolingParams] | None  # one for all, or one each


class PoolOptions(TypedDict, total=False):
    """The keyword options every pooling call takes."""

    truncate_prompt_tokens: int | None  # cut prompts to this many tokens (-1: the model's limit)
    use_tqdm: bool  # a progress bar for long jobs (default True)
    # the instruction prompt before each text: a name of the model's sentence-transformers
    # prompts, or the literal text (sentence-transformers' encode(prompt_name=, prompt=))
    prompt_name: str | None
    prompt: str | None
    # the LoRA adapter every prompt runs under, or one per prompt (None: the base model)
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None


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
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.config.model)
        self.input_processor = InputProcessor(
            self.config.model,
            self.tokenizer,
            self.engine.capabilities,
            media_policy=MediaPolicy(local_paths=True),  # images: the caller's own files too
        )
        # the engine loop (cenote.engine.client): every method here hands its prompts to
        # input_processor.process_batch and runs the requests through this client
        self.client = InProcessClient(self.engine, self.tokenizer)
        self._request_counter = itertools.count()

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self.engine.capabilities.supported_tasks

    def spec_decode_metrics(self) -> SpecDecodeMetrics:
        """Tokens drafted and accepted by speculative decoding (``speculative_config``) since
        this engine started."""
        return SpecDecodeMetrics(self.client.num_draft_tokens, self.client.num_accepted_tokens)

    # ---- pooling ----------------------------------------------------------------------------

    def embed(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        **options: Unpack[PoolOptions],
    ) -> list[PoolingRequestOutput[EmbeddingOutput]]:
        """One embedding per prompt, in input order."""
        return self._pool(EmbeddingOutput, "embed", prompts, pooling_params, **options)

    def embed_query(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        **options: Unpack[PoolOptions],
    ) -> list[PoolingRequestOutput[EmbeddingOutput]]:
        """``embed`` with the model's ``query`` prompt when it has one (sentence-transformers'
        ``encode_query``); ``prompt_name`` / ``prompt`` given override it."""
        return self.embed(prompts, pooling_params, **self._role_prompt("query", options))

    def embed_documents(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        **options: Unpack[PoolOptions],
    ) -> list[PoolingRequestOutput[EmbeddingOutput]]:
        """``embed`` with the model's ``document``, ``passage`` or ``corpus`` prompt, the first
        it has (sentence-transformers' ``encode_document``); ``prompt_name`` / ``prompt``
        given override it."""
        return self.embed(prompts, pooling_params, **self._role_prompt("document", options))

    def _role_prompt(self, role: str, options: PoolOptions) -> PoolOptions:
        """``options`` with the model's prompt for ``role``, unless the caller chose one."""
        if options.get("prompt_name") is not None or options.get("prompt") is not None:
            return options
        name = self.input_processor.prompts.role_prompt_name(role)
        return {**options, "prompt_name": name} if name is not None else options

    def embed_sparse(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        *,
        max_active_dims: int | None = None,
        return_tokens: bool = False,
        **options: Unpack[PoolOptions],
    ) -> list[PoolingRequestOutput[SparseEmbeddingOutput]]:
        """One sparse (SPLADE) embedding per prompt, in input order: ``outputs.pairs`` are its
        (token id, weight) pairs, largest first; only the ``max_active_dims`` largest when given;
        ``outputs.tokens`` are the vocabulary tokens of those ids when ``return_tokens``."""
        outputs = self._pool(
            SparseEmbeddingOutput, "embed_sparse", prompts, pooling_params,
            max_active_dims=max_active_dims, **options,
        )  # fmt: skip
        if return_tokens:
            for out in outputs:
                ids = out.outputs.token_ids
                out.outputs.tokens = [self.tokenizer.id_to_token(i) or "" for i in ids]
        return outputs

    @overload
    def encode(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        *,
        pooling_task: PoolingTask = "embed",
        role: TextRole | None = None,
        **options: Unpack[PoolOptions],
    ) -> list[PoolingRequestOutput[PoolingOutput]]: ...

    @overload
    def encode(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        *,
        pooling_task: tuple[PoolingTask, ...] | list[PoolingTask],
        role: TextRole | None = None,
        **options: Unpack[PoolOptions],
    ) -> list[PoolingRequestOutput[MultiTaskOutput]]: ...

    def encode(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        *,
        pooling_task: PoolingTask | tuple[PoolingTask, ...] | list[PoolingTask] = "embed",
        role: TextRole | None = None,
        **options: Unpack[PoolOptions],
    ) -> list[PoolingRequestOutput[PoolingOutput]] | list[PoolingRequestOutput[MultiTaskOutput]]:
        """The raw pooler output of ``pooling_task`` per prompt (``outputs.data``). Several
        tasks (a tuple or list, e.g. BGE-M3's ``("embed", "embed_sparse", "token_embed")``)
        are read from one trunk pass per prompt: ``outputs`` is then a ``MultiTaskOutput``,
        each task's output under its name (``outputs["embed"].data``). ``role``
        (ColBERT models: colbert-ai and PyLate folders): texts are formatted as a "query"
        (query marker, [MASK] expansion to the query length) or a "document" (the default:
        document marker, cut to the document length), as PyLate's ``encode(is_query=...)``."""
        if role is not None and self.input_processor.prompts.prompt_format is None:
            raise InvalidInputError(
                f"role applies to ColBERT models; {self.config.model.served_model_name} "
                "formats every text alike"
            )
        if isinstance(pooling_task, tuple | list):
            return self._pool(
                MultiTaskOutput, tuple(pooling_task), prompts, pooling_params,
                role=role or "document", **options,
            )  # fmt: skip
        return self._pool(
            PoolingOutput, pooling_task, prompts, pooling_params, role=role or "document",
            **options,
        )  # fmt: skip

    def classify(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        **options: Unpack[PoolOptions],
    ) -> list[PoolingRequestOutput[ClassificationOutput]]:
        """Class probabilities per prompt (``outputs.probs``; ``outputs.label_names``)."""
        return self._pool(ClassificationOutput, "classify", prompts, pooling_params, **options)

    def reward(
        self,
        prompts: Prompts,
        pooling_params: PoolingParamsArg = None,
        **options: Unpack[PoolOptions],
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Reward scores (``outputs.data``): per token (``[num_tokens, num_labels]``, or the STEP
        rows where token == ``step_tag_id``, columns ``returned_token_ids``) on models that
        serve ``token_classify``; else the last-token score (``classify``)."""
        task: PoolingTask = (
            "token_classify" if "token_classify" in self.supported_tasks else "classify"
        )
        return self._pool(PoolingOutput, task, prompts, pooling_params, **options)

    def score(
        self,
        text_1: ScoreItem | Sequence[ScoreItem],
        text_2: ScoreItem | Sequence[ScoreItem],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        max_tokens_per_doc: int | None = None,
        instruction: str | None = None,
        use_tqdm: bool = True,
        rerank_chunking: Literal["max"] | None = None,
        chunk_overlap: int = 0,
        weights_for_different_modes: Sequence[float] | None = None,
        lora_task: str | None = None,
    ) -> list[PoolingRequestOutput[ScoringOutput]]:
        """Relevance of each (text_1, text_2) pair (1 -> 1, 1 -> N, N -> N), in input order.
        Classifiers score pairs as cross-encoders (``pooling_params.use_activation``: the
        model's activation on the logit, default on); embedding models compare embeddings
        (cosine); late-interaction models compare token embeddings (MaxSim); sparse (SPLADE)
        models take the dot product of their sparse embeddings. ``pooling_params`` also carries
        ``truncate_prompt_tokens`` and ``truncation_side``. ``rerank_chunking="max"``
        (cross-encoders): a long text_2 is read in windows overlapping by ``chunk_overlap``
        tokens, text_1 whole in each; its score is its best window's (``outputs.chunk_index``).
        Models with a vision tower (CLIP, SigLIP) also score images (``{"image": ...}``, on
        either side) against texts or images: the cosine of their embeddings.
        ``weights_for_different_modes`` ``[w_dense, w_sparse, w_colbert]`` (BGE-M3; its card
        uses ``[0.4, 0.2, 0.4]``): each text's dense, sparse and ColBERT outputs come from one
        pass and the score is FlagEmbedding's ``compute_score`` "colbert+sparse+dense", their
        scores' weighted mean. ``lora_task`` (or ``pooling_params.lora_task``; the keyword wins),
        Jina v3's per-task adapters: one task's adapter embeds both sides ("text-matching");
        "retrieval" embeds text_1 under "retrieval.query" and text_2 under "retrieval.passage",
        as the model card pairs them."""
        if rerank_chunking not in (None, "max"):
            raise InvalidInputError(
                f"rerank_chunking must be 'max' or None, got {rerank_chunking!r}"
            )
        pairs = scoring.pair_inputs(text_1, text_2)
        (params,) = _bind(
            [pooling_params or PoolingParams()], truncate_prompt_tokens, lora_task=lora_task
        )
        plan = scoring.plan_scores(
            self.input_processor, self._next_id(), pairs, params,
            max_tokens_per_doc=max_tokens_per_doc, instruction=instruction,
            chunk_overlap=chunk_overlap if rerank_chunking == "max" else None,
            mode_weights=weights_for_different_modes,
        )  # fmt: skip
        return plan.scores(
            outputs_of(PoolingRequestOutput, self.client.run(plan.requests, use_tqdm))
        )

    def _pool(
        self,
        kind: type[_Output],
        task: PoolingTaskSelection,
        prompts: Prompts,
        pooling_params: PoolingParamsArg,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        max_active_dims: int | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        role: TextRole = "document",
    ) -> list[PoolingRequestOutput[_Output]]:
        """Run ``task`` on every prompt (its outputs are ``kind``); ``truncate_prompt_tokens``,
        ``max_active_dims`` and the instruction prompt, when given, override the params';
        ``role``: how a ColBERT model formats texts."""
        prompt_list = _as_list(prompts)
        if not prompt_list:
            return []
        given = per_prompt(
            PoolingParams() if pooling_params is None else pooling_params, len(prompt_list)
        )
        # one copy per distinct params object (8,192 prompts under one params: one copy)
        copies: dict[int, PoolingParams] = {}
        for p in given:
            if id(p) not in copies:
                bound = _checked(
                    PoolingParams, p, "encode" if isinstance(task, tuple) else task
                ).with_task(task)
                if prompt_name is not None or prompt is not None:  # the call's replaces the params'
                    bound = dataclasses.replace(bound, prompt_name=prompt_name, prompt=prompt)
                copies[id(p)] = bound
        params = _bind(
            [copies[id(p)] for p in given],
            truncate_prompt_tokens,
            max_active_dims=max_active_dims,
        )
        results = outputs_of(
            PoolingRequestOutput, self._run(prompt_list, params, use_tqdm, lora_request, role)
        )
        assert all(isinstance(out.outputs, kind) for out in results), f"{task} outputs a {kind}"
        return results

    # ---- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Completions of each prompt, in input order (prompts may be text, token ids or chat
        conversations: ``cenote.inputs``), under ``lora_request``'s adapter when given."""
        prompts = _as_list(prompts)
        if not prompts:
            return []
        params = SamplingParams() if sampling_params is None else sampling_params
        # offline calls read only the finished result: no output is built before
        given = [_checked(SamplingParams, p, "generate") for p in per_prompt(params, len(prompts))]
        final = _bind(given, output_kind=RequestOutputKind.FINAL_ONLY)
        return outputs_of(RequestOutput, self._run(prompts, final, use_tqdm, lora_request))

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_call_parser: str = "auto",
        reasoning_parser: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, using the model's chat
        template (or ``chat_template``), rendered in a Jinja sandbox.

        ``tools``: OpenAI function tools, rendered by the template; each completion's
        ``tool_calls`` are those parsed from its text (``tool_call_parser``: hermes,
        llama3_json, mistral; auto: read from the template). ``tool_choice`` "required" or
        ``{"type": "function", "function": {"name": ...}}`` forces a call with a grammar;
        ``parallel_tool_calls=False`` keeps one call per reply. ``reasoning_parser`` (qwen3,
        deepseek_r1) puts the thinking in ``reasoning_content``, unless
        ``chat_template_kwargs`` turn thinking off (``enable_thinking`` false)."""
        conversations = (
            messages
            if messages and isinstance(messages[0], list)
            else [cast(list[dict[str, Any]], messages)]
        )
        template = chat_template or self.input_processor.chat_template
        tool_format = tool_call_format(tool_call_parser, template)
        plan = plan_tools(
            tools, tool_choice, parallel_tool_calls, template, tool_format, self.tokenizer
        )
        prompts: list[PromptType] = [
            ChatPrompt(
                messages=conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                tools=plan.template_tools() if plan else None,
            )
            for conversation in conversations
        ]
        reasoning = request_reasoning(reasoning_format(reasoning_parser), chat_template_kwargs)
        if plan is not None or reasoning is not None:

            def adjust(params: SamplingParams) -> SamplingParams:
                # the forcing grammar and the format's special tokens; then the constraint
                # starts after the thinking
                params = plan.sampling_params(params) if plan is not None else params
                return constrain_after_thinking(
                    params, reasoning, self.tokenizer, chat_template_kwargs
                )

            given = SamplingParams() if sampling_params is None else sampling_params
            sampling_params = (
                adjust(given) if isinstance(given, SamplingParams) else [adjust(p) for p in given]
            )
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        parsed_format = plan.format if plan is not None else None
        max_calls = plan.max_calls if plan is not None else None
        if reasoning is not None or parsed_format is not None:
            for completion in (c for output in outputs for c in output.outputs):
                reply = parse_assistant(
                    completion.text, reasoning, parsed_format, max_calls=max_calls
                )
                completion.reasoning_content = reply.reasoning_content
                if parsed_format is not None:
                    completion.tool_calls = reply.tool_calls
        return outputs

    # ---- the loop ---------------------------------------------------------------------------

    def _run(
        self,
        prompts: list[PromptType],
        params: Sequence[Params],
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        role: TextRole = "document",
    ) -> list[UserOutput]:
        """Process ``prompts`` (every one valid, or nothing runs) and run them to the end."""
        ids = [self._next_id() for _ in prompts]
        if not _made_beside_steps(self.config.model.device, len(prompts)):
            with old_objects_set_aside():
                requests = self.input_processor.process_batch(
                    ids, prompts, params, lora_request=lora_request, role=role
                )
            return self.client.run(requests, use_tqdm)
        params_list = per_prompt(params, len(prompts))
        adapters = per_prompt_adapters(lora_request, len(prompts))
        # every params is checked before anything runs (the parts check their prompts)
        for p in {id(p): p for p in params_list}.values():
            self.input_processor.validator.check(p)

        def part(start: int) -> Callable[[], list[ParentRequest]]:
            end = start + _INPUT_PART
            return lambda: self.input_processor.process_batch(
                ids[start:end],
                prompts[start:end],
                params_list[start:end],
                lora_request=adapters[start:end],
                indices=range(start, min(end, len(prompts))),
                role=role,
            )

        parts = [part(start) for start in range(0, len(prompts), _INPUT_PART)]
        return self.client.run_in_parts(ids, parts, use_tqdm)

    def _next_id(self) -> str:
        return str(next(self._request_counter))


def _checked(kind: type[_Params], params: Params, api: str) -> _Params:
    """``params`` if it is the ``kind`` that ``api`` takes."""
    if not isinstance(params, kind):
        raise InvalidInputTypeError(f"{api} takes {kind.__name__}, got {type(params).__name__}")
    return params


def _as_list(prompts: Prompts) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise InvalidInputTypeError(
        f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}"
    )


def _bind(
    params: list[_Params], truncate_prompt_tokens: int | None = None, **changes: Any
) -> list[_Params]:
    """``params`` with the call's overrides (None: keep the params' value); params objects
    shared by several prompts are copied once."""
    changes = {k: v for k, v in changes.items() if v is not None}
    if truncate_prompt_tokens is not None:
        changes["truncate_prompt_tokens"] = truncate_prompt_tokens
    if not changes:
        return params
    copies = {id(p): dataclasses.replace(p, **changes) for p in params}
    return [copies[id(p)] for p in params]
