"""User prompts + params -> validated, tokenized engine requests: ``InputProcessor.process``.
Every entry point (offline ``LLM``, each HTTP route, run-batch, scoring) hands its raw input
here; all input errors are raised here, as ``InvalidInputError`` with the numbers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import Tokenizer

from cenote.config import ModelConfig
from cenote.engine.capabilities import ModelCapabilities
from cenote.engine.chat import render_chat, special_token_variables
from cenote.engine.chunking import ChunkPlan, split_windows
from cenote.engine.params_validator import Params, ParamsValidator
from cenote.engine.prompt_tokenizer import PromptTokenizer, TokenizedPrompt
from cenote.errors import InvalidInputError, InvalidInputTypeError
from cenote.images.processor import ImageProcessor
from cenote.images.sources import MediaPolicy, open_image
from cenote.inputs import PromptType, TextRole
from cenote.lora.tasks import task_instruction, task_lora_request
from cenote.lora_request import LoRARequest
from cenote.messages import EngineCoreRequest
from cenote.models.tokenizer import load_chat_template
from cenote.pooling_params import PoolingParams
from cenote.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

DEFAULT_MAX_INPUT_CHARS = 1 << 20  # characters in one input text, unless a front sets its own
_CHAT_ARGUMENTS = ("messages", "add_generation_prompt", "continue_final_message", "tools")


@dataclass
class ParentRequest:
    """One user request as the front keeps it: its prompt text and the engine requests it runs
    as — one, or ``n`` for a generation request with ``n > 1`` (ids ``{request_id}-{i}``)."""

    request_id: str  # the user request's id (outputs carry it)
    prompt: str | None  # the prompt's text, when it had one (outputs echo it)
    children: list[EngineCoreRequest]  # what the engine core runs
    truncated: bool = False  # the prompt was cut (truncation; a pair's document)
    chunks: ChunkPlan | None = None  # a long text's windows: how their embeddings join

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's tokens; a chunked one's: every window's, in order (what is computed)."""
        if self.chunks is not None:
            return [t for child in self.children for t in child.prompt_token_ids]
        return self.children[0].prompt_token_ids

    @property
    def pooling_params(self) -> PoolingParams | None:
        return self.children[0].pooling_params


def assign_group(
    requests: Sequence[ParentRequest], group_id: str | None = None, generation: bool = True
) -> None:
    """Make ``requests`` one call for the scheduler's fair shares (``scheduler/group_shares.py``):
    each engine request without a group joins ``group_id`` (None: the first request's id).
    ``generation=False`` leaves completions out (never held): the offline client, whose one
    caller takes every sequence slot as before shares (a served call keeps half of them, so a
    newcomer starts at once; running sequences are not taken back)."""
    if not requests:
        return
    group = group_id if group_id is not None else requests[0].request_id
    for request in requests:
        for child in request.children:
            if child.group_id is None and (generation or child.pooling_params is not None):
                child.group_id = group


class InputProcessor:
    """Validates at the edge, with errors that carry the numbers."""

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        capabilities: ModelCapabilities,
        chat_template: str | None = None,  # None: the model's own
        max_input_chars: int | None = None,  # longer texts (chats once rendered) are refused
        media_policy: MediaPolicy | None = None,  # how images may arrive (None: the defaults)
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.capabilities = capabilities
        self.validator = ParamsValidator(model_config, capabilities)
        self.prompts = PromptTokenizer(model_config, tokenizer, capabilities.uses_token_type_ids)
        self.chat_template = chat_template or load_chat_template(model_config)
        self.max_input_chars = max_input_chars
        self._template_tokens = special_token_variables(tokenizer, model_config.hf_config)
        self.media_policy = media_policy or MediaPolicy()
        self._image_processor: ImageProcessor | None = None  # read at the first image

    @property
    def instruction_length(self) -> int:
        """Tokens of the model's instruction prompt (sentence-transformers' default prompt)."""
        default = self.prompts.default_prompt
        return self.prompts.instruction_length(default) if default else 0

    # ---- the one entry point ----------------------------------------------------------------

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: Params,
        *,
        priority: int = 0,
        **options: Any,
    ) -> ParentRequest:
        """One prompt as a validated, tokenized request (``options``: see ``process_batch``)."""
        return self.process_batch([request_id], [prompt], params, priority=priority, **options)[0]

    def process_batch(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[PromptType],
        params: Params | Sequence[Params],
        *,
        priority: int = 0,
        add_special_tokens: bool | None = None,
        default_max_tokens: int | None = None,
        role: TextRole = "document",
        label: str = "prompt",
        indices: Sequence[int] | None = None,
        max_tokens_per_doc: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ParentRequest]:
        """The requests of ``prompts`` (one params for all, or one each), texts tokenized in one
        call per truncation setting. Truncation is the params' (``truncate_prompt_tokens``,
        ``truncation_side``); a generation params' ``max_tokens=None`` is what the context has
        left (at most ``default_max_tokens``).

        ``add_special_tokens``: None adds them to text and pairs, not to chat (the template
        writes them). ``role``: a ColBERT model formats pooled texts as a "query" or a
        "document". ``label`` and ``indices``: what the user calls the prompts and their
        positions, for error messages ("document 3 has ..."). ``max_tokens_per_doc`` cuts the
        second text of pair prompts. ``lora_request``: the adapter every request runs under, or one per prompt (None: the
        base model).
        Nothing is returned unless every prompt is valid."""
        num = len(prompts)
        indices = list(indices) if indices is not None else list(range(num))
        params_list = per_prompt(params, num)
        # 1) params: the task is served, the options fit this model; a per-task adapter
        # (Jina v3's ``lora_task``) exists and brings its instruction
        for p in {id(p): p for p in params_list}.values():
            self.validator.check(p)
        adapters = per_prompt_adapters(lora_request, num)
        for i, p in enumerate(params_list):
            if isinstance(p, PoolingParams) and p.lora_task is not None:
                params_list[i], adapters[i] = self._task_adapter(p, adapters[i])
        if not INT64_MIN <= priority <= INT64_MAX:
            raise InvalidInputError(f"priority must be a 64-bit signed integer, got {priority}")
        # 2) prompts -> token ids
        tokenized = self._tokenize(
            prompts, params_list, add_special_tokens, role, indices, label, max_tokens_per_doc
        )
        # 3) lengths (long texts chunked where asked); generation: max_tokens resolved, prompt +
        # max_tokens fit the context
        windows: dict[int, tuple[PoolingParams, list[list[int]]]] = {}
        for i, (tok, p) in enumerate(zip(tokenized, params_list, strict=True)):
            if tok.pixel_values is not None:
                continue  # an image's length is the vision tower's, whatever the text limit
            if isinstance(p, PoolingParams) and p.long_input == "chunk":
                if len(tok.prompt_token_ids) > self.model_config.max_model_len:
                    windows[i] = (p, self._windows(tok, p, indices[i]))
                    continue
            self._check_length(tok.prompt_token_ids, indices[i], label)
            if isinstance(p, SamplingParams):
                num_tokens = len(tok.prompt_token_ids)
                params_list[i] = self._fit_context(p, num_tokens, indices[i], default_max_tokens)
        # 4) engine requests; n > 1 and a chunked text's windows fan out
        parents = [
            self._chunked(request_id, tok, *windows[i], priority)
            if i in windows
            else self._parent(request_id, tok, p, priority)
            for i, (request_id, tok, p) in enumerate(
                zip(request_ids, tokenized, params_list, strict=True)
            )
        ]
        # 5) the adapter each runs under (the core loads it, or refuses the request)
        for parent, adapter in zip(parents, adapters, strict=True):
            assign_adapter([parent], adapter)
        return parents

    def process_pair_windows(
        self,
        request_id: str,
        pairs: list[tuple[str, str]],
        params: PoolingParams,
        overlap: int,
        *,
        priority: int = 0,
        max_tokens_per_doc: int | None = None,
    ) -> list[list[ParentRequest]]:
        """Chunk-and-max reranking: per pair, one request per window of its document (ids
        ``{request_id}-{pair}-{window}``), each the query and a window that fit the model."""
        self.validator.check(params)
        if not INT64_MIN <= priority <= INT64_MAX:
            raise InvalidInputError(f"priority must be a 64-bit signed integer, got {priority}")
        for i, (query, document) in enumerate(pairs):
            self._check_chars(query, "pair", i, "'s text")
            self._check_chars(document, "pair", i, "'s text_pair")
        limit = self.model_config.max_model_len
        windows = self.prompts.pair_windows(
            pairs, limit, max_tokens_per_doc, overlap, list(range(len(pairs)))
        )
        return [
            [
                self._parent(f"{request_id}-{i}-{w}", tok, params, priority)
                for w, tok in enumerate(ws)
            ]
            for i, ws in enumerate(windows)
        ]

    def _task_adapter(
        self, params: PoolingParams, adapter: LoRARequest | None
    ) -> tuple[PoolingParams, LoRARequest]:
        """The adapter of ``params.lora_task``, and the params with the task's instruction as
        their prompt when they name none (the remote code's ``encode(task=)`` puts it before
        every text; sentence-transformers with ``prompt_name=task``)."""
        assert params.lora_task is not None
        if adapter is not None:
            raise InvalidInputError(
                f"task {params.lora_task!r} selects the model's own adapter; it cannot run "
                f"under adapter {adapter.lora_name!r} too",
                param="task",
            )
        task_adapter = task_lora_request(self.model_config, params.lora_task)
        if params.prompt is None and params.prompt_name is None:
            instruction = task_instruction(self.model_config, params.lora_task)
            params = dataclasses.replace(params, prompt=instruction)
        return params, task_adapter

    def check_task(self, task: str) -> None:
        """``UnsupportedTaskError`` unless the model serves ``task``."""
        self.validator.check_task(task)

    def render_chat(self, prompt: Mapping[str, Any]) -> str:
        """The text of a chat prompt (``cenote.inputs.ChatPrompt``), rendered in the sandbox."""
        variables = dict(prompt.get("chat_template_kwargs") or {})
        reserved = [name for name in _CHAT_ARGUMENTS if name in variables]
        if reserved:
            raise InvalidInputError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: they are request fields"
            )
        return render_chat(
            prompt.get("chat_template") or self.chat_template,
            prompt["messages"],
            prompt.get("add_generation_prompt", True),
            prompt.get("continue_final_message", False),
            **{**self._template_tokens, **variables, "tools": prompt.get("tools")},
        )

    def truncate_texts(self, texts: list[str], max_tokens: int) -> list[str]:
        """Each text cut to its first ``max_tokens`` tokens (e.g. documents before they go into
        a reranker's prompt template); a text that fits is returned as it is."""
        return self.prompts.cut_texts(texts, max_tokens)

    # ---- 2) tokenization --------------------------------------------------------------------

    def _tokenize(
        self,
        prompts: Sequence[PromptType],
        params_list: list[Params],
        add_special_tokens: bool | None,
        role: TextRole,
        indices: list[int],
        label: str,
        max_tokens_per_doc: int | None,
    ) -> list[TokenizedPrompt]:
        """Token ids of every prompt: given ids are checked and cut; texts and pairs go through
        the tokenizer in one call per (kind, truncation, side, special tokens, pooling)."""
        results: list[TokenizedPrompt | None] = [None] * len(prompts)
        # (kind, truncation length, side, special tokens, instruction) -> (index, text or pair)
        groups: dict[
            tuple[str, int | None, Literal["left", "right"], bool, str | None],
            list[tuple[int, Any]],
        ] = {}
        for i, (typed_prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            prompt: Any = typed_prompt  # the caller's input, checked here whatever its type
            max_length = self.validator.truncation_length(params.truncate_prompt_tokens)
            side = params.truncation_side
            if isinstance(prompt, dict) and "image" in prompt:
                results[i] = self._image(prompt["image"], params, indices[i], label)
                continue
            if not self.capabilities.embeds_text:
                raise InvalidInputError(
                    f"{label} {indices[i]} is text, but {self.model_config.architecture} is an "
                    "image-only folder (a vision tower, no text tower): send images"
                )
            if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                ids = self._check_token_ids(prompt["prompt_token_ids"], indices[i])
                truncated = max_length is not None and len(ids) > max_length
                if truncated and max_length is not None:
                    ids = ids[-max_length:] if side == "left" else ids[:max_length]
                results[i] = TokenizedPrompt(prompt.get("prompt"), ids, truncated=truncated)
                continue
            kind, value, special = self._text_of(prompt, indices[i], label, add_special_tokens)
            instruction = None  # pooled texts only: the instruction prompt in front
            if isinstance(params, PoolingParams):
                instruction = self.prompts.instruction(params.prompt_name, params.prompt)
            key = (kind, max_length, side, special, instruction)
            groups.setdefault(key, []).append((i, value))
        for (kind, max_length, side, special, instruction), items in groups.items():
            values = [value for _, value in items]
            if kind == "pair":
                positions = [indices[i] for i, _ in items]
                batch = self.prompts.pairs(values, max_length, max_tokens_per_doc, positions)
            else:
                batch = self.prompts.texts(values, max_length, side, special, instruction, role)
            for (i, _), tok in zip(items, batch, strict=True):
                results[i] = tok
        return results  # type: ignore[return-value]

    def _image(self, source: Any, params: Params, index: int, label: str) -> TokenizedPrompt:
        """An image prompt: decoded under the media policy, preprocessed as the folder says,
        with one placeholder token id per image token."""
        where = f"{label} {index}"
        num_tokens, size = self.capabilities.num_image_tokens, self.capabilities.image_size
        if num_tokens is None or size is None:
            raise InvalidInputError(
                f"{where} is an image, but this model has no vision tower "
                f"({self.model_config.architecture} embeds texts only)"
            )
        if not isinstance(params, PoolingParams) or params.task != "embed":
            task = params.task if isinstance(params, PoolingParams) else "generate"
            raise InvalidInputError(f"{where} is an image; images are embedded only, not {task}")
        image = open_image(source, self.media_policy, where)
        if self._image_processor is None:
            self._image_processor = ImageProcessor.from_folder(self.model_config.path, size)
        pixels = self._image_processor(image)  # [3, size, size]
        if tuple(pixels.shape[1:]) != (size, size):
            raise InvalidInputError(
                f"{where}: preprocessing gave {tuple(pixels.shape[1:])} pixels, the vision "
                f"tower takes ({size}, {size}); check {self.model_config.path}'s "
                "preprocessor_config.json"
            )
        return TokenizedPrompt(None, [0] * num_tokens, pixel_values=pixels)

    def _text_of(
        self, prompt: Any, index: int, label: str, add_special_tokens: bool | None
    ) -> tuple[str, Any, bool]:
        """(kind "text" | "pair", the text or (text, text_pair), whether to add special
        tokens) of a prompt that is not token ids; chat prompts are rendered here. Every text
        is held to ``max_input_chars`` before it is tokenized."""
        if isinstance(prompt, str):
            return "text", self._check_chars(prompt, label, index), add_special_tokens is not False
        if isinstance(prompt, dict):
            if isinstance(prompt.get("prompt"), str):
                text = self._check_chars(prompt["prompt"], label, index)
                return "text", text, add_special_tokens is not False
            if "messages" in prompt:
                text = self._check_chars(self.render_chat(prompt), label, index, " (rendered)")
                return "text", text, bool(add_special_tokens)
            if isinstance(prompt.get("text"), str) and isinstance(prompt.get("text_pair"), str):
                text = self._check_chars(prompt["text"], label, index, "'s text")
                text_pair = self._check_chars(prompt["text_pair"], label, index, "'s text_pair")
                return "pair", (text, text_pair), True
        raise InvalidInputTypeError(
            f"prompt {index} is a {type(prompt).__name__}; expected a string or a dict with "
            "'prompt' (text), 'prompt_token_ids' (list of ints), 'messages' (chat) or "
            "'text' and 'text_pair' (a cross-encoder pair)"
        )

    def _check_chars(self, text: str, label: str, index: int, part: str = "") -> str:
        limit = self.max_input_chars
        if limit is not None and len(text) > limit:
            raise InvalidInputError(
                f"{label} {index}{part} has {len(text)} characters, more than the limit of "
                f"{limit} (max_input_chars)"
            )
        return text

    def _check_token_ids(self, ids: Any, index: int) -> list[int]:
        if not isinstance(ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise InvalidInputTypeError(f"prompt {index}: prompt_token_ids must be a list of ints")
        vocab = self.model_config.vocab_size
        for position, token_id in enumerate(ids):
            if not 0 <= token_id < vocab:
                raise InvalidInputError(
                    f"prompt {index}: token id {token_id} at position {position} is outside the "
                    f"vocabulary (size {vocab})"
                )
        return list(ids)

    # ---- 3) lengths -------------------------------------------------------------------------

    def _check_length(self, ids: list[int], index: int, label: str) -> None:
        limit = self.model_config.max_model_len
        if not ids:
            raise InvalidInputError(f"{label} {index} is empty (0 tokens)")
        if len(ids) > limit:
            raise InvalidInputError(
                f"{label} {index} has {len(ids)} tokens, but the model's limit (max_model_len) is "
                f"{limit}; pass truncate_prompt_tokens=-1 (or a value up to {limit}) to truncate it"
            )

    def _fit_context(
        self,
        params: SamplingParams,
        num_prompt_tokens: int,
        index: int,
        default_max_tokens: int | None,
    ) -> SamplingParams:
        """``params`` with ``max_tokens`` resolved; the prompt and its completion must fit."""
        limit = self.model_config.max_model_len
        if params.max_tokens is None:
            max_tokens = max(limit - num_prompt_tokens, 1)
            if default_max_tokens is not None:
                max_tokens = min(max_tokens, default_max_tokens)
            params = dataclasses.replace(params, max_tokens=max_tokens)
        assert params.max_tokens is not None
        if num_prompt_tokens + params.max_tokens > limit:
            raise InvalidInputError(
                f"prompt {index} has {num_prompt_tokens} tokens and asks for max_tokens="
                f"{params.max_tokens}, which exceeds the model's limit (max_model_len) of {limit}"
            )
        return params

    # ---- 4) requests ------------------------------------------------------------------------

    def _parent(
        self, request_id: str, prompt: TokenizedPrompt, params: Params, priority: int
    ) -> ParentRequest:
        if isinstance(params, PoolingParams):
            if prompt.num_instruction_tokens:
                params = dataclasses.replace(
                    params, instruction_length=prompt.num_instruction_tokens
                )
            children = [self._request(request_id, prompt, None, params, priority)]
        else:
            ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
            children = [
                self._request(child_id, prompt, _child_params(params, i), None, priority)
                for i, child_id in enumerate(ids)
            ]
        return ParentRequest(request_id, prompt.prompt, children, prompt.truncated)

    def _windows(
        self, prompt: TokenizedPrompt, params: PoolingParams, index: int
    ) -> list[list[int]]:
        """A long prompt's windows, each framed as the whole prompt is (``chunking``)."""
        ids = prompt.prompt_token_ids
        prefix, suffix = self.prompts.special_frame
        head = len(prefix) if ids[: len(prefix)] == prefix else 0
        head = max(head, prompt.num_instruction_tokens)
        tail = len(suffix) if suffix and ids[len(ids) - len(suffix) :] == suffix else 0
        limit = self.model_config.max_model_len
        return split_windows(ids, head, tail, limit, params.chunk_overlap, index)

    def _chunked(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        params: PoolingParams,
        windows: list[list[int]],
        priority: int,
    ) -> ParentRequest:
        """One engine request per window (ids ``{request_id}-w{i}``): un-normalized, full-size
        embeddings that the output processor joins by ``ChunkPlan``."""
        instruction = prompt.num_instruction_tokens
        window_params = dataclasses.replace(
            params, normalize=False, dimensions=None, instruction_length=instruction
        )
        st = self.model_config.st_config
        skipped = instruction if st is not None and not st.include_prompt else 0  # not pooled
        weights = tuple(len(w) - skipped for w in windows)  # tokens each window pools
        normalize = params.normalize
        if normalize is None:
            normalize = self.capabilities.normalizes_embeddings
        children = [
            self._request(
                f"{request_id}-w{i}",
                TokenizedPrompt(None, ids, None, instruction),
                None,
                window_params,
                priority,
            )  # fmt: skip
            for i, ids in enumerate(windows)
        ]
        plan = ChunkPlan(tuple(max(w, 1) for w in weights), params.dimensions, normalize)
        return ParentRequest(request_id, prompt.prompt, children, prompt.truncated, plan)

    def _request(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        sampling_params: SamplingParams | None,
        pooling_params: PoolingParams | None,
        priority: int,
    ) -> EngineCoreRequest:
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt.prompt_token_ids,
            sampling_params=sampling_params,
            pooling_params=pooling_params,
            token_type_ids=prompt.token_type_ids,
            eos_token_id=self.capabilities.eos_token_id,
            priority=priority,
            pixel_values=prompt.pixel_values,
        )


def per_prompt(params: Params | Sequence[Params], count: int) -> list[Params]:
    """One params per prompt: the same for all, or one each (the counts must match)."""
    if isinstance(params, SamplingParams | PoolingParams):
        return [params] * count
    if isinstance(params, str | bytes) or not isinstance(params, Sequence):
        raise InvalidInputTypeError(
            "params must be SamplingParams or PoolingParams (or a list of them, one per "
            f"prompt), got {type(params).__name__}"
        )
    params = list(params)
    if len(params) != count:
        raise InvalidInputError(f"got {len(params)} parameter sets for {count} prompts")
    return params


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n completions; seeded requests get seed + i so completions differ."""
    if params.n == 1:
        return params
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, seed=seed)


def assign_adapter(requests: Sequence[ParentRequest], lora_request: LoRARequest | None) -> None:
    """Run every engine request of ``requests`` under ``lora_request`` (None: the base)."""
    for parent in requests:
        for child in parent.children:
            child.lora_request = lora_request


def per_prompt_adapters(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: the same for all, or one each (the counts must match)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    adapters = list(lora_request)
    if len(adapters) != count:
        raise InvalidInputError(
            f"got {len(adapters)} lora_request entries for {count} prompts; give one for all "
            "or one per prompt"
        )
    for adapter in adapters:
        if adapter is not None and not isinstance(adapter, LoRARequest):
            raise InvalidInputTypeError(
                f"lora_request entries must be LoRARequest or None, got {type(adapter).__name__}"
            )
    return adapters
