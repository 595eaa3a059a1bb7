"""The FastAPI app: front door (auth, body bound, readiness, metrics) and the small routes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import cenote
from cenote.engine.heap import freeze_startup_objects
from cenote.server import (
    routes_batches,
    routes_cohere,
    routes_generate,
    routes_lora,
    routes_models,
    routes_pooling,
    routes_scoring,
    routes_sparse,
    routes_tei,
    timing,
)
from cenote.server.batch_jobs import BatchJobs
from cenote.server.batch_store import BatchStore
from cenote.server.body import JSONRoute, answer_tei
from cenote.server.errors import (
    APIError,
    BadRequest,
    BodyError,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    api_error_response,
    install_error_handlers,
    tei_error_response,
)
from cenote.server.on_demand import OnDemandModel, current_leases
from cenote.server.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    chat_prompt,
)
from cenote.server.request_log import log_request
from cenote.server.responses import (
    DetokenizeResponse,
    HealthResponse,
    VersionResponse,
    any_of,
    install_openapi,
    schema,
    shared_schema,
)
from cenote.server.served_models import ServedModels, get_served, get_state
from cenote.server.state import ServerOptions, ServerState
from cenote.server.tei_protocol import TEITokenizeRequest
from cenote.server.timing import RequestTimings
from cenote.server.tracing import RequestTracer

logger = logging.getLogger(__name__)

router = APIRouter(route_class=JSONRoute)
_OPEN_PATHS = frozenset({"/health"})  # reachable without the API key


def build_app(served: ServedModels, tracer: RequestTracer | None = None) -> FastAPI:
    """The app over ``served``; ``tracer``: every request's trace goes to it (``--otlp-traces-
    endpoint``; None: no tracing, nothing of it runs)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        jobs = app.state.batch_jobs = _batch_jobs(app, served.options)
        start = asyncio.create_task(_start_engines(served, jobs))
        try:
            yield
        finally:
            start.cancel()
            if jobs is not None:  # lines in flight stop here and run again after a restart
                await jobs.stop()
            await served.shutdown()
            if tracer is not None:
                tracer.shutdown()  # the spans still batched are sent

    app = FastAPI(title="cenote", version=cenote.__version__, lifespan=lifespan)
    app.state.cenote = served
    app.state.batch_jobs = None  # set by the lifespan when --batch-dir is given
    install_error_handlers(app)
    install_openapi(app)
    app.include_router(router)
    app.include_router(routes_models.router)  # /v1/models, /models/load, /models/unload
    app.include_router(routes_pooling.router)
    app.include_router(routes_sparse.router)  # TEI /embed_sparse
    app.include_router(routes_scoring.router)
    app.include_router(routes_cohere.router)  # Cohere /v2/embed
    app.include_router(routes_tei.router)  # text-embeddings-inference's own routes
    app.include_router(routes_generate.router)
    # always mounted (without --batch-dir each route is a 404 saying so); documented when on
    app.include_router(
        routes_batches.router, include_in_schema=served.options.batch_dir is not None
    )
    if served.options.enable_lora_runtime_updating:  # else 404, as vLLM without the flag
        app.include_router(routes_lora.router)
    app.add_middleware(FrontDoor, served=served, tracer=tracer)
    return app


def _batch_jobs(app: FastAPI, options: ServerOptions) -> BatchJobs | None:
    if options.batch_dir is None:
        return None
    store = BatchStore(Path(options.batch_dir))
    return BatchJobs(store, app, options.batch_concurrency, options.max_body_bytes, options.api_key)


async def _start_engines(served: ServedModels, jobs: BatchJobs | None) -> None:
    await served.start()
    if served.not_serving() is not None:
        return
    if jobs is not None:
        jobs.start()  # unfinished batches resume here
    freeze_startup_objects()  # the front process's modules, routes and tokenizers
    options = served.options
    logger.info(
        "cenote ready on http://%s:%d serving %s",
        options.host, options.port, ", ".join(repr(name) for name in served.names),
    )  # fmt: skip


class FrontDoor:
    """ASGI middleware: API key, body size, readiness; once the response is sent, the request's
    metrics (by endpoint, and by task when the engine answered), ``--log-requests`` line and
    trace."""

    def __init__(self, app: ASGIApp, served: ServedModels, tracer: RequestTracer | None) -> None:
        self.app = app
        self.served = served
        self.tracer = tracer
        self.log_requests = served.options.log_requests
        self.log_max_chars = served.options.log_requests_max_chars

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500
        timings = timing.RequestTimings()  # filled by the handler (cenote/server/timing.py)
        token = timing.current_timings.set(timings)
        leases: list[OnDemandModel] = []  # the --models-dir models the handler routes to
        leases_token = current_leases.set(leases)

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if timings.ran and status == 200:
                    message = {**message, "headers": [*message["headers"], *timings.headers()]}
            await send(message)

        try:
            error = self._check(scope)
            if error is not None:
                answer = tei_error_response if path in routes_tei.TEI_PATHS else api_error_response
                await answer(error)(scope, receive, send_with_status)
            else:
                await self.app(scope, self._bounded(scope, receive), send_with_status)
        finally:
            timing.current_timings.reset(token)
            current_leases.reset(leases_token)
            if self.served.on_demand is not None:  # the response is sent: they may unload
                self.served.on_demand.release(leases)
            self._observe(scope, path, status, timings)

    def _observe(self, scope: Scope, path: str, status: int, timings: RequestTimings) -> None:
        """Metrics, the request's log line and its trace, once its response is sent."""
        endpoint = self._endpoint(scope, path)
        metrics = self.served.metrics
        metrics.record_request(endpoint, status)
        seconds = time.monotonic() - timings.started
        if timings.model is not None and timings.task is not None and status == 200:
            metrics.record_task(timings.model, timings.task, timings.num_tokens, seconds)
        method = scope["method"]
        if self.log_requests and method == "POST":
            log_request(method, endpoint, status, seconds, timings, self.log_max_chars)
        if self.tracer is not None:
            self.tracer.trace(scope["headers"], method, endpoint, status, timings)

    def _check(self, scope: Scope) -> APIError | None:
        path = scope["path"]
        headers = dict(scope["headers"])
        api_key = self.served.options.api_key
        if api_key and path not in _OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return Unauthorized("missing or wrong API key (send 'Authorization: Bearer <key>')")
        limit = _body_limit(scope, self.served.options)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return PayloadTooLarge(
                f"the request body has {int(length)} bytes, the limit is {limit}"
            )
        if scope["method"] == "POST":
            return self.served.not_serving()
        return None

    def _bounded(self, scope: Scope, receive: Receive) -> Receive:
        limit, received = _body_limit(scope, self.served.options), 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body without Content-Length
                    raise BodyError(413, f"the request body exceeds the limit of {limit} bytes")
            return message

        return bounded_receive

    @staticmethod
    def _endpoint(scope: Scope, path: str) -> str:
        route = scope.get("route")
        return getattr(route, "path", None) or ("unknown" if route is None else path)


def _body_limit(scope: Scope, options: ServerOptions) -> int:
    """Bytes a request body may hold: a batch file upload has its own bound."""
    if scope["path"] == "/v1/files" and scope["method"] == "POST":
        return options.max_batch_file_bytes + routes_batches.MULTIPART_SLACK_BYTES
    return options.max_body_bytes


# ---- small routes ---------------------------------------------------------------------------


@router.get("/health", responses=schema(HealthResponse, 503))
async def health(raw_request: Request) -> JSONResponse:
    """One model: ok, degraded (data parallel, some cores gone) or 503 (starting, dead, hung).
    Several: each model's entry under ``models`` (``ServedModels.health``)."""
    served = get_served(raw_request)
    if len(served.states) > 1 or served.on_demand is not None:
        status, body = served.health()
        if status != 200:
            raise Unavailable(f"not ready: {body['message']}")
        return JSONResponse(body)
    assert served.default is not None  # one --model model
    problem = served.default.health_problem()
    if problem is None:
        return JSONResponse({"status": "ok"})
    if problem["status"] == "degraded":
        return JSONResponse(problem)
    if problem["status"] == "hung":
        raise Unavailable(problem["reason"])
    raise Unavailable(f"not ready: {problem['reason']}")


@router.get("/version", responses=schema(VersionResponse, 401))
async def version() -> JSONResponse:
    return JSONResponse({"version": cenote.__version__})


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"},
        **schema(None, 401)},
)  # fmt: skip
async def metrics(raw_request: Request) -> Response:
    return Response(get_served(raw_request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post(
    "/tokenize",
    responses=shared_schema("TokenizeResponse", "TEITokenizeResponse"),
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": any_of("TokenizeRequest", "TEITokenizeRequest")}}}},
)  # fmt: skip
async def tokenize(raw_request: Request) -> Response:
    """vLLM's body (``prompt`` or ``messages``) or text-embeddings-inference's (``inputs``,
    answered and refused in TEI's shapes)."""
    body = await raw_request.json()
    if isinstance(body, dict) and "inputs" in body:
        return await answer_tei(raw_request, TEITokenizeRequest, _tei_tokenize)
    try:
        parsed = TokenizeRequest.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    state = await get_state(raw_request, parsed.model)
    return JSONResponse(await state.offload(_tokenize, state, parsed))  # off the event loop


async def _tei_tokenize(body: TEITokenizeRequest, raw_request: Request) -> Response:
    state = await get_state(raw_request)
    return JSONResponse(await state.offload(routes_tei.tei_tokenize, state, body))


def _tokenize(state: ServerState, body: TokenizeRequest) -> dict[str, Any]:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("pass exactly one of 'prompt' and 'messages'", param="prompt")
    text = body.prompt
    add_special_tokens = body.add_special_tokens
    if body.messages is not None:
        text = state.processor().render_chat(chat_prompt(body, body.messages))
        add_special_tokens = bool(add_special_tokens)  # the template writes them (vLLM)
    elif add_special_tokens is None:
        add_special_tokens = True
    assert text is not None  # one of prompt and messages
    state.check_texts([text], "prompt")
    ids = state.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    token_strs = (
        [state.tokenizer.id_to_token(t) or "" for t in ids] if body.return_token_strs else None
    )
    return {
        "tokens": ids, "count": len(ids), "max_model_len": state.model_config.max_model_len,
        "token_strs": token_strs,  # null unless asked (vLLM)
    }  # fmt: skip


@router.post("/detokenize", responses=schema(DetokenizeResponse, 400, 401, 404, 413, 503))
async def detokenize(body: DetokenizeRequest, raw_request: Request) -> JSONResponse:
    state = await get_state(raw_request, body.model)
    state.check_model(body.model)
    vocab = state.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})", "tokens")
    text = await state.offload(state.tokenizer.decode, body.tokens, skip_special_tokens=True)
    return JSONResponse({"prompt": text})


_INVOCATION_BODIES = ("ChatCompletionRequest", "CompletionRequest", "RerankRequest", "ScoreRequest",
                      "EmbeddingRequest", "ClassificationRequest", "PoolingRequest")  # fmt: skip
_INVOCATION_ANSWERS = ("ChatCompletionResponse", "CompletionResponse", "RerankResponse",
                       "ScoreResponse", "EmbeddingResponse", "ClassificationResponse",
                       "PoolingResponse")  # fmt: skip


def _any_of(names: tuple[str, ...]) -> dict[str, Any]:
    return {"anyOf": [{"$ref": f"#/components/schemas/{name}"} for name in names]}


def _invocation_responses() -> dict[int | str, dict[str, Any]]:
    """The answer of whichever route the body is for (JSON, SSE or raw bytes), or an error."""
    responses = schema(None, stream=True, binary=True)
    responses[200]["content"]["application/json"] = {"schema": _any_of(_INVOCATION_ANSWERS)}
    return responses


@router.post(
    "/invocations",
    responses=_invocation_responses(),
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": _any_of(_INVOCATION_BODIES)}}}},
)  # fmt: skip
async def invocations(raw_request: Request) -> Response:
    """SageMaker's one route: the body's shape picks the API. ``messages``: chat when the model
    generates, else embeddings; ``prompt``: completions; ``query`` + ``documents``: rerank;
    ``queries`` / ``data_1`` / ``text_1``: score; ``input``: embeddings, classify or pooling,
    by the tasks of the model the body names (else the first)."""
    body = await raw_request.json()
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    named = body.get("model")  # a wrong type is refused by the body's own validation
    state = await get_state(raw_request, named if isinstance(named, str) else None)
    handler, model = _invocation_target(state, body)
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    response: Response = await handler(parsed, raw_request=raw_request)
    return response


def _invocation_target(
    state: ServerState, body: dict[str, Any]
) -> tuple[Callable[..., Awaitable[Response]], type[BaseModel]]:
    tasks = state.supported_tasks
    generates = "generate" in tasks
    if "messages" in body and generates:
        return routes_generate.create_chat_completion, ChatCompletionRequest
    if "prompt" in body and generates:
        return routes_generate.create_completion, CompletionRequest
    if "query" in body and "documents" in body:
        return routes_scoring.create_rerank, RerankRequest
    if any(key in body for key in ("queries", "data_1", "text_1")):
        return routes_scoring.create_score, ScoreRequest
    if "input" in body or "messages" in body:
        if "embed" in tasks:
            return routes_pooling.create_embeddings, EmbeddingRequest
        if "classify" in tasks:
            return routes_scoring.create_classify, ClassificationRequest
        return routes_pooling.create_pooling, PoolingRequest
    raise BadRequest(
        "cannot tell which API this body is for: send 'messages' (chat), 'prompt' "
        "(completions), 'input' (embeddings / classify / pooling), 'query' and 'documents' "
        "(rerank) or 'queries' and 'documents' (score)"
    )
