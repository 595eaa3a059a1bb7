"""Request bodies of the HTTP API (OpenAI- and vLLM-compatible field names)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from cenote.tasks import PoolingTask

StrictInt = Annotated[int, Strict()]  # a JSON integer: true / 1.5 / "1" are refused
TokenIds = list[StrictInt]
PromptInput = str | list[str] | TokenIds | list[TokenIds]
ChatMessages = list[dict[str, Any]]  # checked by cenote.engine.chat (roles, content parts)
EmbedDType = Literal["float32", "float16", "bfloat16"]
Endianness = Literal["native", "big", "little"]


class _Body(BaseModel):
    """Unknown fields are refused with a 400 naming them (nothing is silently ignored)."""

    model_config = ConfigDict(extra="forbid")


class _ChatInput(_Body):
    """Chat-template options, for routes that take ``messages``."""

    add_generation_prompt: bool = False
    continue_final_message: bool = False  # leave the last (assistant) message open
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables


class _PoolingBody(_ChatInput):
    model: str | None = None
    input: PromptInput | None = None  # one or many texts or token-id lists
    messages: ChatMessages | None = None  # chat-style input, rendered by the template
    encoding_format: Literal["float", "base64", "bytes"] = "float"  # bytes: raw body + header
    embed_dtype: EmbedDType = "float32"  # element type of base64 / bytes output
    endianness: Endianness = "native"  # byte order of base64 / bytes output
    dimensions: StrictInt | None = None  # matryoshka truncation
    user: str | None = None
    truncate_prompt_tokens: StrictInt | None = None  # -1 = the model's limit
    truncation_side: Literal["left", "right"] = "right"  # which end truncation cuts
    normalize: bool | None = None  # embeddings: L2 normalization; None = the model's default
    use_activation: bool | None = None  # classifier activation / embedding normalization
    add_special_tokens: bool | None = None  # None: yes for input, no for messages (as vLLM)
    priority: StrictInt = 0
    request_id: str | None = None


class EmbeddingRequest(_PoolingBody):
    """POST /v1/embeddings."""

    # cenote extension: sparse (SPLADE) models answer {"indices": [...], "values": [...]}
    sparse: bool = False


class PoolingRequest(_PoolingBody):
    """POST /pooling: the raw pooler output of ``task``."""

    task: PoolingTask | None = None  # None: embed when supported, else the model's first task


class ClassificationRequest(_PoolingBody):
    """POST /classify (vLLM): class probabilities per input."""


class _ScoringBody(_Body):
    model: str | None = None
    truncate_prompt_tokens: StrictInt | None = None  # -1 = the model's limit; cuts documents
    max_tokens_per_doc: StrictInt | None = None  # cut each document to this many tokens
    use_activation: bool | None = None  # cross-encoders: sigmoid etc.; None = the model's default
    instruction: str | None = None  # for rerankers with a prompt template (Qwen3-Reranker)
    user: str | None = None
    priority: StrictInt = 0
    request_id: str | None = None


ScoreTexts = str | list[str]


class ScoreRequest(_ScoringBody):
    """POST /score, /v1/score (vLLM): 1 -> 1, 1 -> N or N -> N pairs, given as
    ``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2`` or
    ``text_1``/``text_2``."""

    queries: ScoreTexts | None = None
    documents: ScoreTexts | None = None
    items: ScoreTexts | None = None  # vLLM's other name for documents
    data_1: ScoreTexts | None = None
    data_2: ScoreTexts | None = None
    text_1: ScoreTexts | None = None
    text_2: ScoreTexts | None = None


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_ScoringBody):
    """POST /rerank, /v1/rerank (Jina) and /v2/rerank (Cohere). Documents are cut to fit the
    model (the query is kept whole), as Cohere and Jina do; ``max_tokens_per_doc`` cuts more."""

    query: str
    documents: list[str | RerankDocument]  # strings or {"text": ...}
    top_n: StrictInt | None = None  # None or 0: every document
    return_documents: bool | None = None  # None: yes on /rerank and /v1/rerank, no on /v2

    @property
    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # usage so far in every chunk (vLLM)


class _GenerationBody(_Body):
    model: str | None = None
    max_tokens: StrictInt | None = None  # default: 16 (completions), the context left (chat)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = 0
    min_p: float = 0.0
    n: StrictInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: StrictInt = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: StrictInt | None = None  # top logprobs per prompt token (vLLM)
    return_token_ids: bool = False  # token ids of prompt and completion in each choice (vLLM)
    truncate_prompt_tokens: StrictInt | None = None  # keep this many prompt tokens
    truncation_side: Literal["left", "right"] = "left"  # generation keeps the prompt's end
    user: str | None = None
    priority: StrictInt = 0
    request_id: str | None = None
    # OpenAI fields cenote does not implement: refused with a 400 when they ask for anything
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    best_of: StrictInt | None = None


class CompletionRequest(_GenerationBody):
    """POST /v1/completions."""

    prompt: PromptInput
    logprobs: StrictInt | None = Field(default=None, ge=0)  # top logprobs per generated token
    echo: bool = False  # the prompt before the completion (with its logprobs when asked)
    suffix: str | None = None  # not implemented: refused when given
    add_special_tokens: bool = True


class ChatCompletionRequest(_GenerationBody):
    """POST /v1/chat/completions."""

    messages: ChatMessages
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the template writes the special tokens (vLLM)


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
    tokens: list[StrictInt]
