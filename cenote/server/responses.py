"""Response bodies of the HTTP API, declared for the OpenAPI schema (the contract).

Routes build their bodies as plain dicts and encode them with msgspec (fast); these models say
what those dicts hold. ``schema(...)`` turns them into a route's ``responses=`` entries.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import JsonSchemaMode

from cenote.server.errors import ErrorResponse, TEIErrorResponse, error_responses
from cenote.server.protocol import TokenizeRequest
from cenote.server.tei_protocol import (
    TEIEmbedSparseResponse,
    TEIRerankRequest,
    TEIRerankResponse,
    TEITokenizeRequest,
    TEITokenizeResponse,
)


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = None  # generation routes only


# ---- small routes -----------------------------------------------------------------------------


class ModelHealth(BaseModel):
    status: Literal["ok", "degraded", "starting", "dead", "hung"]
    reason: str | None = None  # why it is not ok
    dead_engines: dict[str, str] | None = None  # data parallel: core rank -> why it is gone


class HealthResponse(BaseModel):
    # degraded: some engine cores are gone (data parallel), or some models do not serve
    status: Literal["ok", "degraded"]
    dead_engines: dict[str, str] | None = None  # one model: core rank -> why it is gone
    models: dict[str, ModelHealth] | None = None  # several models: each one's state


class EngineCore(BaseModel):
    num_threads: int  # torch threads
    cpu_ids: list[int]  # CPUs the core process may run on


class VersionResponse(BaseModel):
    version: str


class ModelStatus(BaseModel):
    """Whether a model is loaded (llama.cpp's router: ``status.value``)."""

    value: Literal["loaded", "loading", "unloading", "unloaded", "failed"]
    reason: str | None = None  # why it failed


class ModelCard(BaseModel):
    id: str  # the served model name (never a path)
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the served model name
    parent: str | None = None
    max_model_len: int | None  # null for a --models-dir model not loaded
    supported_tasks: list[str]
    engine_cores: list[EngineCore]  # once started (cenote serve --model: the CPU policy)
    status: ModelStatus


class ModelStatusResponse(BaseModel):
    """POST /models/load and /models/unload."""

    model: str
    status: Literal["loaded", "unloaded"]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- pooling ----------------------------------------------------------------------------------


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of embed_dtype values


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: Usage


class PoolingData(BaseModel):
    object: Literal["pooling"]
    index: int
    # the pooler's output (nested for per-token tasks), or base64; a request for several tasks
    # (cenote extension): task -> that output
    data: list[Any] | str | dict[str, list[Any] | str]


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[PoolingData]
    usage: Usage


class ClassificationData(BaseModel):
    index: int
    label: str | int  # the class name, or its index when the model names none
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassificationData]
    usage: Usage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankText(BaseModel):
    """A returned document: its text, or (an image document) vLLM's ``multi_modal`` content
    part as it was sent."""

    text: str | None = None
    multi_modal: dict[str, Any] | None = None


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    chunk_index: int | None = None  # rerank_chunking "max": the document's best window
    document: RerankText | None = None  # with return_documents


class RerankUsage(Usage):
    truncated_documents: int = 0  # documents cut to fit the model (or max_tokens_per_doc)


class RerankResponse(BaseModel):
    """Jina's shape."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class RerankMeta(BaseModel):
    api_version: dict[str, Any]
    billed_units: dict[str, Any]
    warnings: list[str] | None = None  # e.g. documents truncated


class RerankV2Response(BaseModel):
    """Cohere v2's shape (plus ``usage``)."""

    id: str
    model: str
    results: list[RerankResult]
    meta: RerankMeta
    usage: RerankUsage


class CohereEmbeddings(BaseModel):
    """One list per asked ``embedding_types`` entry (binary ones packed 8 dimensions a byte)."""

    model_config = ConfigDict(populate_by_name=True)

    float_: list[list[float]] | None = Field(default=None, alias="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None  # float32, little-endian


class CohereBilledUnits(BaseModel):
    input_tokens: int  # tokens of the texts (an image's placeholder rows are not counted)
    images: int | None = None  # images embedded, when there are any


class CohereEmbedMeta(BaseModel):
    api_version: dict[str, str]
    billed_units: CohereBilledUnits


class CohereEmbedResponse(BaseModel):
    """Cohere Embed v2's ``EmbedByTypeResponse``."""

    id: str
    response_type: Literal["embeddings_by_type"]
    embeddings: CohereEmbeddings
    texts: list[str]  # the request's ``texts``; empty for ``images`` and ``inputs``
    meta: CohereEmbedMeta


# ---- generation -------------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # with prompt_logprobs
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None: empty, with tool calls or reasoning parsed
    reasoning_content: str | None = None  # with --reasoning-parser: the thinking
    tool_calls: list[ToolCall] | None = None  # with tools: the calls parsed from the text


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # with prompt_logprobs
    prompt_token_ids: list[int] | None = None  # with return_token_ids


# stream: true; the schema of one event (as schemathesis and OpenAPI 3.2's itemSchema read an
# event stream's schema), its data a JSON chunk or "[DONE]"
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "properties": {
                "data": {"type": "string"},
                "event": {"type": "string"},
                "id": {"type": "string"},
                "retry": {"type": "integer"},
            },
            "required": ["data"],
        }
    }
}
_BYTES = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


def schema(
    model: type[BaseModel] | None, *errors: int, stream: bool = False, binary: bool = False
) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: its 200 body (JSON, SSE when it streams, raw bytes for
    ``encoding_format: bytes``) and the error statuses it can answer (all when none given)."""
    ok: dict[str, Any] = {"description": "Success"}
    if model is not None:
        ok["model"] = model
    extra = {**(_SSE if stream else {}), **(_BYTES if binary else {})}
    if extra:
        ok["content"] = extra
    return {200: ok, **error_responses(*errors)}


# ---- text-embeddings-inference's routes -------------------------------------------------------

_TEI_STATUSES: dict[int | str, str] = {
    400: "An empty batch, or a body that is not JSON",
    401: "Missing or wrong API key",
    413: "Request body too large",
    422: "Invalid input: wrong types, too many inputs, too long without truncate",
    424: "The served model does not do what the route asks",
    429: "Overloaded: retry after the Retry-After header's seconds",
    500: "A bug (an error id names its traceback in the server log)",
    503: "The engine is starting or not running",
}
# bodies of routes two APIs share, named only in anyOf lists: added to the schema's components
_SHARED_BODIES = (TEIRerankRequest, TEIRerankResponse, TEITokenizeRequest, TEITokenizeResponse,
                  TEIEmbedSparseResponse)  # fmt: skip


def tei_schema(
    model: type[BaseModel] | None, answers: tuple[str, ...] = ()
) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route of TEI's API: its 200 body (``model``, or one of the schemas
    named ``answers``) and TEI-shaped errors."""
    ok: dict[str, Any] = {"description": "Success"}
    if model is not None:
        ok["model"] = model
    if answers:
        ok["content"] = {"application/json": {"schema": any_of(*answers)}}
    responses: dict[int | str, dict[str, Any]] = {200: ok}
    for status, description in _TEI_STATUSES.items():
        responses[status] = {"model": TEIErrorResponse, "description": description}
    return responses


def any_of(*names: str) -> dict[str, Any]:
    return {"anyOf": [{"$ref": f"#/components/schemas/{name}"} for name in names]}


def shared_schema(*answers: str) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a path two APIs share: one of ``answers``, errors in either shape."""
    ok = {"description": "Success", "content": {"application/json": {"schema": any_of(*answers)}}}
    responses: dict[int | str, dict[str, Any]] = {200: ok}
    errors = {"application/json": {"schema": any_of("ErrorResponse", "TEIErrorResponse")}}
    descriptions = dict(_TEI_STATUSES)
    for status, entry in error_responses().items():
        descriptions[status] = entry["description"]
    for status, description in descriptions.items():
        responses[status] = {"description": description, "content": errors}
    return responses


def _add_schemas(schemas: dict[str, Any], models: tuple[type[BaseModel], ...]) -> None:
    for model in models:
        mode: JsonSchemaMode = "validation"
        if not model.__name__.endswith("Request"):
            mode = "serialization"
        spec = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
        for name, definition in spec.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        schemas.setdefault(model.__name__, spec)


def install_openapi(app: FastAPI) -> None:
    """The app's schema without FastAPI's automatic 422 answers: a body that fails validation
    is a 400 (documented per route with ``ErrorResponse``), as OpenAI and vLLM answer (TEI's
    routes document their own 422)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=app.description
            )
            for operations in spec.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    if "HTTPValidationError" in str(responses.get("422")):  # FastAPI's own
                        del responses["422"]
            schemas = spec.get("components", {}).get("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            shared = (TokenizeRequest, TokenizeResponse, ErrorResponse, TEIErrorResponse)
            _add_schemas(schemas, (*_SHARED_BODIES, *shared))
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
