"""Request bodies of the HTTP API (OpenAI- and vLLM-compatible field names)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cenote.tasks import PoolingTask

TokenIds = list[int]
PromptInput = str | list[str] | TokenIds | list[TokenIds]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _PoolingBody(_Body):
    model: str | None = None
    input: PromptInput | None = None  # one or many texts or token-id lists
    messages: list[dict[str, Any]] | None = None  # chat-style input, rendered by the template
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # matryoshka truncation
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # -1 = the model's limit
    normalize: bool | None = None
    use_activation: bool | None = None  # classifier activation; None = the model's default
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None


class EmbeddingRequest(_PoolingBody):
    """POST /v1/embeddings."""


class PoolingRequest(_PoolingBody):
    """POST /pooling: the raw pooler output of ``task``."""

    task: PoolingTask | None = None  # None: embed when supported, else the model's first task


class ClassificationRequest(_PoolingBody):
    """POST /classify (vLLM): class probabilities per input."""


class _ScoringBody(_Body):
    model: str | None = None
    truncate_prompt_tokens: int | None = None  # -1 = the model's limit; cuts documents first
    max_tokens_per_doc: int | None = None  # cut each document to this many tokens
    use_activation: bool | None = None  # cross-encoders: sigmoid etc.; None = the model's default
    instruction: str | None = None  # for rerankers with a prompt template (Qwen3-Reranker)
    user: str | None = None
    priority: int = 0
    request_id: str | None = None


class ScoreRequest(_ScoringBody):
    """POST /score, /v1/score (vLLM): 1 -> 1, 1 -> N or N -> N pairs."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankDocument(_Body):
    text: str


class RerankRequest(_ScoringBody):
    """POST /rerank, /v1/rerank (Jina) and /v2/rerank (Cohere)."""

    query: str
    documents: list[str | RerankDocument]  # strings or {"text": ...}
    top_n: int | None = None  # None or 0: every document
    return_documents: bool | None = None  # None: yes on /rerank and /v1/rerank, no on /v2

    @property
    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationBody(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    priority: int = 0
    request_id: str | None = None


class CompletionRequest(_GenerationBody):
    """POST /v1/completions."""

    prompt: PromptInput
    logprobs: int | None = Field(default=None, ge=0)  # top logprobs per generated token
    echo: bool = False


class ChatCompletionRequest(_GenerationBody):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    """POST /tokenize: ``prompt`` text or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
