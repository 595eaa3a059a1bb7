"""Request bodies of the HTTP API (OpenAI- and vLLM-compatible field names)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, Strict

from cenote.engine.scoring import ScoreItem
from cenote.errors import InvalidInputError
from cenote.inputs import ChatPrompt, ImagePrompt, PromptType, TokensPrompt
from cenote.pooling_params import PoolingParams
from cenote.sampling_params import INT64_MAX, INT64_MIN, RequestOutputKind, SamplingParams
from cenote.structured.params import StructuredOutputsParams
from cenote.tasks import PoolingTask, PoolingTaskSelection

StrictInt = Annotated[int, Strict()]  # a JSON integer: true / 1.5 / "1" are refused
# integers with the bounds the engine enforces, stated in the OpenAPI schema
Int64 = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]  # 0 or more
PositiveCount = Annotated[int, Strict(), Field(ge=1, le=INT64_MAX)]
TruncateTokens = Annotated[int, Strict(), Field(ge=-1, le=INT64_MAX)]  # -1: the model's limit
# BGE-M3's [w_dense, w_sparse, w_colbert] (FlagEmbedding's weights_for_different_modes)
ModeWeights = Annotated[list[Annotated[float, Field(ge=0)]], Field(min_length=3, max_length=3)]
TokenIds = list[StrictInt]
PromptInput = str | list[str] | TokenIds | list[TokenIds]
EmbedDType = Literal["float32", "float16", "bfloat16"]
Endianness = Literal["native", "big", "little"]


class _Body(BaseModel):
    """Unknown fields are refused with a 400 naming them (nothing is silently ignored), and
    every value must have its JSON type: ``"stream": 1``, ``"yes"``, ``"1"`` for a number or
    ``true`` for an integer are refused, not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ContentPart(BaseModel):
    """One part of a message's content; cenote.engine.chat reads text parts and refuses the
    others with a 400 naming the part."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class FunctionCallMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str | dict[str, Any]  # OpenAI: a JSON object as text; the template gets a dict


class ToolCallMessage(BaseModel):
    """A tool call of an earlier assistant turn."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallMessage


class ChatMessage(BaseModel):
    """An OpenAI chat message. Other fields (``name``, ``reasoning_content``...) are kept for
    the chat template; null or no content renders as "" (an assistant turn of tool calls)."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class FunctionTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


ChatMessages = Annotated[list[ChatMessage], Field(min_length=1)]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them (the fields the client sent)."""
    return [m.model_dump(exclude_unset=True) for m in messages]


class _ChatInput(_Body):
    """Chat-template options, for routes that take ``messages``."""

    add_generation_prompt: bool = False
    continue_final_message: bool = False  # leave the last (assistant) message open
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables


def chat_prompt(body: _ChatInput | ChatCompletionRequest, messages: ChatMessages) -> ChatPrompt:
    """``messages`` with the body's chat-template options."""
    return ChatPrompt(
        messages=message_dicts(messages),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs,
    )


def image_prompt(messages: ChatMessages) -> ImagePrompt | None:
    """The image of ``messages`` with an ``image_url`` content part, as vLLM sends one to CLIP
    and SigLIP: exactly one image and no text (a two-tower model embeds one or the other; send
    texts as ``input``); None when no part is an image."""
    parts = [
        part for m in messages if isinstance(m.content, list) for part in m.content
    ]  # fmt: skip
    images = [part for part in parts if part.type == "image_url"]
    if not images:
        return None
    texts = [part.text for part in parts if part.type != "image_url" and part.text]
    texts += [m.content for m in messages if isinstance(m.content, str) and m.content]
    if len(images) > 1 or texts:
        raise InvalidInputError(
            f"messages hold {len(images)} image_url parts and {len(texts)} texts; an image "
            "embedding takes exactly one image_url part and no text (send texts as 'input')",
            param="messages",
        )
    return _image_of(images[0], "messages")


def _image_of(part: ContentPart, param: str) -> ImagePrompt:
    """The image an ``image_url`` content part points to (its URL, opened by the input
    processor under the server's media policy)."""
    extra = part.model_extra or {}
    image_url = extra.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise InvalidInputError(
            "an image_url part must be {'type': 'image_url', 'image_url': {'url': '...'}}",
            param=param,
        )
    return ImagePrompt(image=url)


def prompts_of(input_: PromptInput | None) -> list[PromptType]:
    """Text, texts, token ids or token-id lists as prompts (at least one, none empty)."""
    if input_ is None:
        raise InvalidInputError("pass exactly one of 'input' and 'messages'", param="input")
    items: list[str] | list[list[int]]
    if isinstance(input_, str):
        items = [input_]
    elif input_ and all(isinstance(x, int) for x in input_):
        items = [[x for x in input_ if isinstance(x, int)]]
    else:
        items = cast("list[str] | list[list[int]]", list(input_))  # texts, or token-id lists
    if not items:
        raise InvalidInputError(
            "input is empty: pass at least one text or token-id list", param="input"
        )
    for i, item in enumerate(items):
        if not item:
            kind = "string" if isinstance(item, str) else "token list"
            raise InvalidInputError(f"input {i} is an empty {kind}", param="input")
    return [
        item if isinstance(item, str) else TokensPrompt(prompt_token_ids=item) for item in items
    ]


class _PoolingBody(_ChatInput):
    model: str | None = None
    input: PromptInput | None = None  # one or many texts or token-id lists
    messages: ChatMessages | None = None  # chat-style input, rendered by the template
    # bytes: raw body + header; int8 / uint8 / binary / ubinary (/v1/embeddings only):
    # sentence-transformers' quantize_embeddings
    encoding_format: Literal["float", "base64", "bytes", "int8", "uint8", "binary", "ubinary"] = (
        "float"
    )
    embed_dtype: EmbedDType = "float32"  # element type of base64 / bytes output
    endianness: Endianness = "native"  # byte order of base64 / bytes output
    dimensions: PositiveCount | None = None  # matryoshka truncation
    user: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None  # -1 = the model's limit
    truncation_side: Literal["left", "right"] = "right"  # which end truncation cuts
    normalize: bool | None = None  # embeddings: L2 normalization; None = the model's default
    use_activation: bool | None = None  # classifier activation / embedding normalization
    add_special_tokens: bool | None = None  # None: yes for input, no for messages (as vLLM)
    # the instruction prompt before each text: one of the model's prompts by name, or literal
    prompt_name: str | None = None
    prompt: str | None = None
    # embeddings of texts over max_model_len: "error" (400) or "chunk" (windows joined into one
    # embedding); None: the server's --long-input
    long_input: Literal["error", "chunk"] | None = None
    chunk_overlap: Count | None = None  # tokens shared by neighbouring windows
    # Jina v3: the checkpoint's per-task LoRA adapter ("retrieval.query", ...); /v1/embeddings
    # also takes it as ``task``, as Jina's API names it
    lora_task: str | None = None
    priority: Int64 = 0
    request_id: str | None = None

    def adapter_task(self) -> str | None:
        """The per-task adapter asked for (``lora_task``)."""
        return self.lora_task

    def prompts(self) -> list[PromptType]:
        """The prompts of ``input``, or one prompt of ``messages``: an image when they hold an
        ``image_url`` part (vLLM's shape for CLIP / SigLIP), else a chat."""
        if self.messages is not None and self.input is None:
            image = image_prompt(self.messages)
            return [image if image is not None else chat_prompt(self, self.messages)]
        return prompts_of(self.input if self.messages is None else None)

    def to_pooling_params(
        self,
        task: PoolingTaskSelection,
        auto_truncate: bool = False,
        long_input: Literal["error", "chunk"] = "error",
        chunk_overlap: int = 0,
    ) -> PoolingParams:
        """``auto_truncate``: inputs without ``truncate_prompt_tokens`` are cut to the model's
        limit (the server's ``--auto-truncate``); ``long_input`` / ``chunk_overlap``: the
        server's defaults for embeddings (a request's own choice wins)."""
        chunk = self.long_input or (long_input if task == "embed" else "error")
        truncate = self.truncate_prompt_tokens
        if truncate is None and auto_truncate and chunk != "chunk":
            truncate = -1
        normalize = self.normalize
        tasks = task if isinstance(task, tuple) else (task,)
        if normalize is None and {"embed", "token_embed"} & set(tasks):
            normalize = self.use_activation  # vLLM's newer name for embedding normalization
        return PoolingParams(
            task=task,
            dimensions=self.dimensions,
            normalize=normalize,
            use_activation=self.use_activation,
            truncate_prompt_tokens=truncate,
            truncation_side=self.truncation_side,
            prompt_name=self.prompt_name,
            prompt=self.prompt,
            long_input=chunk,
            chunk_overlap=chunk_overlap if self.chunk_overlap is None else self.chunk_overlap,
            lora_task=self.adapter_task(),
        )


def one_adapter_task(task: str | None, lora_task: str | None) -> str | None:
    """The per-task adapter a body names as Jina's ``task`` or cenote's ``lora_task`` (400 when
    both are given and differ)."""
    if task is not None and lora_task is not None and task != lora_task:
        raise InvalidInputError(
            f"task {task!r} and lora_task {lora_task!r} name different adapters; pass one",
            param="task",
        )
    return task if task is not None else lora_task


class EmbeddingRequest(_PoolingBody):
    """POST /v1/embeddings."""

    # Jina's API (jina-embeddings-v3): the per-task adapter, as ``lora_task``
    task: str | None = None

    def adapter_task(self) -> str | None:
        return one_adapter_task(self.task, self.lora_task)

    # cenote extension: sparse (SPLADE) models answer {"indices": [...], "values": [...]}
    sparse: bool = False
    # int8 / uint8 encoding_format: per-dimension [[min, ...], [max, ...]] (sentence-transformers'
    # ``ranges``); without them the request's own inputs give them, as its encode(precision=) does
    quantization_ranges: list[list[float]] | None = None


class PoolingRequest(_PoolingBody):
    """POST /pooling: the raw pooler output of ``task``."""

    # None: embed when supported, else the model's first task. cenote extension: a list of
    # tasks (BGE-M3's ["embed", "embed_sparse", "token_embed"]) read from one trunk pass,
    # each input's ``data`` then a map of task -> output
    task: PoolingTask | list[PoolingTask] | None = None

    def task_selection(self, default: PoolingTask) -> PoolingTaskSelection:
        """The task, or the tasks as a tuple; ``default`` when the body names none."""
        if isinstance(self.task, list):
            return tuple(self.task)
        return self.task or default


class ClassificationRequest(_PoolingBody):
    """POST /classify (vLLM): class probabilities per input."""


class _ScoringBody(_Body):
    model: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None  # -1 = the model's limit; cuts documents
    max_tokens_per_doc: Count | None = None  # cut each document to this many (0: no cut)
    use_activation: bool | None = None  # cross-encoders: sigmoid etc.; None = the model's default
    instruction: str | None = None  # for rerankers with a prompt template (Qwen3-Reranker)
    truncation_side: Literal["left", "right"] = "right"  # which end truncation cuts
    user: str | None = None
    priority: Int64 = 0
    request_id: str | None = None
    # cenote extension (BGE-M3): [w_dense, w_sparse, w_colbert] — each text's three outputs
    # from one pass, scored as FlagEmbedding's compute_score "colbert+sparse+dense"
    weights_for_different_modes: ModeWeights | None = None
    # Jina v3's per-task adapter for embedding-model scores, as /v1/embeddings names it (Jina's
    # ``task``, or ``lora_task``): one adapter for both sides, or "retrieval" for
    # retrieval.query on queries and retrieval.passage on documents (lora.tasks.score_tasks)
    task: str | None = None
    lora_task: str | None = None

    def window_overlap(self) -> int | None:
        """Chunk-and-max reranking's window overlap; None: documents are not chunked."""
        return None

    def to_pooling_params(self) -> PoolingParams:
        """The options scoring takes from the body (its task is scoring's)."""
        return PoolingParams(
            use_activation=self.use_activation,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side,
            lora_task=one_adapter_task(self.task, self.lora_task),
        )


class ScoreContent(_Body):
    """vLLM's multimodal score input (its ``ScoreMultiModalParam``): ``{"content": [parts]}``,
    each part an ``image_url`` (as in chat messages) or a ``text``."""

    content: Annotated[list[ContentPart], Field(min_length=1)]


# a text, texts, or vLLM's multimodal inputs: one {"content": [...]} whose every part is an
# input (vLLM's first shape), or a list whose elements are texts or {"content": [one part]}
ScoreInputs = str | ScoreContent | list[str | ScoreContent]


def score_items(value: ScoreInputs, param: str) -> list[ScoreItem]:
    """The texts and images of one side of a score or rerank body, in order."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, ScoreContent):
        return [_score_item(part, f"{param}.content[{i}]") for i, part in enumerate(value.content)]
    items: list[ScoreItem] = []
    for i, element in enumerate(value):
        if isinstance(element, str):
            items.append(element)
        elif len(element.content) != 1:
            raise InvalidInputError(
                f"{param}[{i}] holds {len(element.content)} content parts; each input of a list "
                "takes exactly one (an image_url or a text part). To score several, list them "
                "as elements, or as the parts of one top-level {'content': [...]}",
                param=param,
            )
        else:
            items.append(_score_item(element.content[0], f"{param}[{i}]"))
    return items


def _score_item(part: ContentPart, where: str) -> ScoreItem:
    if part.type == "image_url":
        return _image_of(part, where)
    if part.type == "text" and isinstance(part.text, str):
        return part.text
    raise InvalidInputError(
        f"{where} is a {part.type!r} part; score inputs take 'image_url' parts and 'text' parts "
        "(with their text)",
        param=where,
    )


class ScoreRequest(_ScoringBody):
    """POST /score, /v1/score (vLLM): 1 -> 1, 1 -> N or N -> N pairs, given as
    ``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2`` or
    ``text_1``/``text_2``; each side a text, texts, or vLLM's multimodal ``{"content": [...]}``
    inputs (images, for models with a vision tower: ``ScoreInputs``)."""

    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    items: ScoreInputs | None = None  # vLLM's other name for documents
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None
    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None

    _FIELDS: ClassVar = (
        ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")
    )  # fmt: skip

    def inputs(self) -> tuple[list[ScoreItem], list[ScoreItem]]:
        """The inputs of the one pair of fields the body gives (queries, documents)."""
        sent = {n for names in self._FIELDS for n in names if getattr(self, n) is not None}
        given = [names for names in self._FIELDS if sent.issuperset(names)]
        if len(given) != 1 or sent != set(given[0]):
            raise InvalidInputError(
                "pass one pair of fields: queries and documents (or queries and items, data_1 "
                "and data_2, text_1 and text_2)",
                param="queries",
            )
        first, second = given[0]
        return score_items(getattr(self, first), first), score_items(getattr(self, second), second)


def check_query(query: str) -> None:
    """A rerank query with text in it: an empty one scores every document against nothing."""
    if not query.strip():
        raise InvalidInputError(
            f"query is empty ({len(query)} characters, none but whitespace): rerank needs a "
            "query text",
            param="query",
        )


class RerankDocument(BaseModel):
    model_config = ConfigDict(strict=True)  # other fields of a document object are ignored

    text: str


class RerankRequest(_ScoringBody):
    """POST /rerank, /v1/rerank (Jina) and /v2/rerank (Cohere). Documents are cut to fit the
    model (the query is kept whole), as Cohere and Jina do; ``max_tokens_per_doc`` cuts more."""

    query: str | ScoreContent  # a text, or vLLM's {"content": [one image_url or text part]}
    # strings or {"text": ...}; vLLM's multimodal inputs: elements {"content": [one part]}, or
    # one {"content": [parts]} whose every part is a document
    documents: list[str | RerankDocument | ScoreContent] | ScoreContent
    top_n: Count | None = None  # None or 0: every document
    return_documents: bool | None = None  # None: yes on /rerank and /v1/rerank, no on /v2
    # "max": a cross-encoder reads a long document in windows (the query whole in each) and
    # scores it by its best window (results carry its chunk_index); None: cut to fit
    rerank_chunking: Literal["max"] | None = None
    chunk_overlap: Count | None = None  # tokens neighbouring windows share (default 0)

    def window_overlap(self) -> int | None:
        if self.rerank_chunking is None:
            if self.chunk_overlap is not None:
                raise InvalidInputError(
                    "chunk_overlap applies with rerank_chunking 'max'", param="chunk_overlap"
                )
            return None
        return self.chunk_overlap or 0

    def _document_inputs(self) -> list[str | ScoreContent]:
        """One element per document (a top-level {"content": [...]}: one per part)."""
        if isinstance(self.documents, ScoreContent):
            return [ScoreContent(content=[part]) for part in self.documents.content]
        return [d.text if isinstance(d, RerankDocument) else d for d in self.documents]

    def inputs(self) -> tuple[ScoreItem, list[ScoreItem]]:
        """The query (a text not empty, or an image) and the documents (at least one)."""
        if isinstance(self.query, str):
            check_query(self.query)
            query: ScoreItem = self.query
        else:
            (query,) = score_items([self.query], "query")
        documents = self._document_inputs()
        if not documents:
            raise InvalidInputError("rerank needs at least one document, got 0", param="documents")
        if self.top_n is not None and self.top_n < 0:
            raise InvalidInputError(
                f"top_n must be 0 (all) or positive, got {self.top_n}", param="top_n"
            )
        return query, score_items(documents, "documents")

    def results(
        self,
        scores: list[float],
        return_documents: bool,
        chunk_indices: list[int | None] | None = None,
    ) -> list[dict[str, Any]]:
        """By relevance (best first, ties in input order), the top ``top_n``; each with its
        document unless ``return_documents`` (default: the route's) says otherwise, and its
        best window's ``chunk_index`` when documents were chunked."""
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if self.top_n:
            order = order[: self.top_n]
        if self.return_documents is not None:
            return_documents = self.return_documents
        documents = self._document_inputs()
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if chunk_indices is not None and chunk_indices[i] is not None:
                result["chunk_index"] = chunk_indices[i]
            if return_documents:
                result["document"] = _returned_document(documents[i])
            results.append(result)
        return results


def _returned_document(document: str | ScoreContent) -> dict[str, Any]:
    """A rerank result's document: ``{"text": ...}``, or vLLM's ``{"multi_modal": part}``."""
    if isinstance(document, str):
        return {"text": document}
    (part,) = document.content
    if part.type == "text":
        return {"text": part.text}
    return {"multi_modal": part.model_dump(exclude_unset=True)}


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of json, json_object, regex, choice, grammar."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF / EBNF (``::=`` rules)
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # vLLM's back-end options: one back end here, nothing to pick
    disable_any_whitespace: bool = False  # no whitespace between JSON tokens (vLLM)


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # usage so far in every chunk (vLLM)


class _GenerationBody(_Body):
    """Value ranges are SamplingParams' (declared here so the schema states them); limits
    that depend on the model (vocabulary, max_model_len, max_logprobs) are checked later."""

    model: str | None = None
    max_tokens: PositiveCount | None = None  # default: 16 (completions), the context left (chat)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=-1, le=INT64_MAX)  # 0 or -1: off
    min_p: float = Field(default=0.0, ge=0, le=1)
    n: PositiveCount = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Count] | None = None
    seed: Int64 | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    # token id (as a string) -> bias
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Count | None = None  # top logprobs per prompt token (vLLM)
    return_token_ids: bool = False  # token ids of prompt and completion in each choice (vLLM)
    truncate_prompt_tokens: TruncateTokens | None = None  # keep this many (-1: the model's limit)
    truncation_side: Literal["left", "right"] = "left"  # generation keeps the prompt's end
    user: str | None = None
    priority: Int64 = 0
    request_id: str | None = None
    response_format: ResponseFormat | None = None
    best_of: PositiveCount | None = None  # refused beyond n
    # structured outputs: vLLM's field, its older guided_* names, OpenAI's response_format
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted; llguidance is the one back end

    default_max_tokens: ClassVar[int | None] = None  # without max_tokens: the context left

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever of its fields gives one (at most one
        may); a bad schema, regex or grammar is an InvalidInputError naming the field."""
        given: dict[str, dict[str, Any]] = {}
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given["structured_outputs"] = dict(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=so.json_object,
                whitespace_pattern="" if so.disable_any_whitespace else so.whitespace_pattern,
                disable_additional_properties=so.disable_additional_properties,
            )  # fmt: skip
        guided = dict(
            json=self.guided_json, regex=self.guided_regex, choice=self.guided_choice,
            grammar=self.guided_grammar,
        )  # fmt: skip
        for name, value in guided.items():
            if value is not None:
                given[f"guided_{name}"] = {name: value}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = _response_format_constraint(self.response_format)
        if len(given) > 1:
            raise InvalidInputError(
                f"give one output constraint, not {len(given)} ({', '.join(given)})",
                param=next(iter(given)),
            )
        if not given:
            return None
        ((field, constraint),) = given.items()
        if self.guided_whitespace_pattern is not None and field != "structured_outputs":
            constraint.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        try:
            return StructuredOutputsParams(**constraint)
        except InvalidInputError as e:
            raise InvalidInputError(str(e), param=field) from e

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        logit_bias: dict[int, float] | None,
        output_kind: RequestOutputKind,
    ) -> SamplingParams:
        structured = self.structured_outputs_params()
        return SamplingParams(
            structured_outputs=structured,
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=logit_bias,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side, output_kind=output_kind,
        )  # fmt: skip


def _response_format_constraint(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"json_object": True}
    schema = response_format.json_schema
    if schema is None:
        raise InvalidInputError(
            "response_format of type json_schema needs its json_schema", param="response_format"
        )
    # OpenAI's strict mode: every object closes (additionalProperties false unless it says)
    return {
        "json": schema.schema_ if schema.schema_ is not None else {"type": "object"},
        "disable_additional_properties": bool(schema.strict),
    }


class CompletionRequest(_GenerationBody):
    """POST /v1/completions."""

    prompt: PromptInput
    logprobs: Count | None = None  # top logprobs per generated token
    echo: bool = False  # the prompt before the completion (with its logprobs when asked)
    suffix: str | None = None  # not implemented: refused when given
    add_special_tokens: bool = True

    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's and vLLM's default

    def prompts(self) -> list[PromptType]:
        return prompts_of(self.prompt)

    def to_sampling_params(
        self,
        logit_bias: dict[int, float] | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    ) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # echoed prompt tokens carry their logprobs
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._sampling_params(
            self.max_tokens, self.logprobs, prompt_logprobs, logit_bias, output_kind
        )


class ChatCompletionRequest(_GenerationBody):
    """POST /v1/chat/completions."""

    messages: ChatMessages
    max_completion_tokens: PositiveCount | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the template writes the special tokens (vLLM)
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # None: allowed, as OpenAI
    functions: list[FunctionDefinition] | None = None  # legacy tools
    function_call: Literal["none", "auto"] | FunctionName | None = None  # legacy tool_choice

    def tool_fields(self) -> tuple[list[dict[str, Any]] | None, Any, bool]:
        """(tools, tool_choice, legacy) with legacy ``functions`` / ``function_call`` as tools;
        ``legacy``: the request used them."""
        if self.functions is None and self.function_call is None:
            tools = [t.model_dump(exclude_none=True) for t in self.tools or []] or None
            choice = self.tool_choice
            return tools, choice.model_dump() if isinstance(choice, BaseModel) else choice, False
        if self.tools is not None or self.tool_choice is not None:
            raise InvalidInputError(
                "pass tools and tool_choice, or the legacy functions and function_call, not both",
                param="functions",
            )
        functions = [{"type": "function", "function": f.model_dump(exclude_none=True)}
                     for f in self.functions or []] or None  # fmt: skip
        call = self.function_call
        if isinstance(call, FunctionName):
            return functions, {"type": "function", "function": {"name": call.name}}, True
        return functions, call, True

    def prompts(self, tools: list[dict[str, Any]] | None = None) -> list[PromptType]:
        """The chat prompt; ``tools``: the definitions its template renders."""
        prompt = chat_prompt(self, self.messages)
        if tools:
            prompt["tools"] = tools
        return [prompt]

    def to_sampling_params(
        self,
        logit_bias: dict[int, float] | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    ) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        return self._sampling_params(
            max_tokens, logprobs, self.prompt_logprobs, logit_bias, output_kind
        )


class TokenizeRequest(_ChatInput):
    """POST /tokenize: ``prompt`` text or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: ChatMessages | None = None
    add_special_tokens: bool | None = None  # None: yes for prompt, no for messages (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # the token strings beside their ids


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[Int64]
