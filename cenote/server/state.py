"""What every route shares: the engine client, the input processor, options and metrics."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from fastapi import Request

from cenote.assistant.reasoning import reasoning_format
from cenote.assistant.tool_parsers import ToolCallFormat, tool_call_format
from cenote.config import EngineConfig
from cenote.engine.async_client import AsyncEngineClient
from cenote.engine.client import run_async
from cenote.engine.dp_client import DataParallelEngineClient
from cenote.engine.embedding_cache import CacheSize, EmbeddingCache, parse_cache_size
from cenote.engine.input_processor import DEFAULT_MAX_INPUT_CHARS, InputProcessor, ParentRequest
from cenote.engine.output_processor import outputs_of
from cenote.engine_args import option, parse_bytes
from cenote.images.sources import DEFAULT_MAX_IMAGE_PIXELS, MediaPolicy
from cenote.inputs import PromptType
from cenote.lora.manager import LoRAManager, shape_checker
from cenote.lora_request import LoRARequest
from cenote.models.tokenizer import load_tokenizer
from cenote.outputs import PoolingRequestOutput
from cenote.server import timing
from cenote.server.errors import BadRequest, ModelNotFound, Overloaded, Unavailable
from cenote.server.metrics import MetricFamilies, ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


COHERE_INPUT_TYPES = ("search_query", "search_document", "classification", "clustering")


def parse_input_type_prompts(text: str) -> dict[str, str]:
    """``--input-type-prompts``: a JSON object of Cohere input_type -> literal prompt."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise argparse.ArgumentTypeError(
            'expected a JSON object of strings, e.g. {"search_query": "query: "}'
        )
    unknown = sorted(set(value) - set(COHERE_INPUT_TYPES))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown input_type {unknown}; choose among {list(COHERE_INPUT_TYPES)}"
        )
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """The server's own options: bounds on what a request may do, access control, connections
    (the engine's are ``EngineArgs``). ``cenote serve`` has one flag per field made with
    ``option`` (``max_inputs`` -> ``--max-inputs``), with its help text and default."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health",
        shown="the CENOTE_API_KEY environment variable; unset or empty: no key",
    )
    chat_template: str | None = option(
        None, "a Jinja chat template, or the file holding one", shown="the model's own"
    )
    max_body_bytes: int = option(16 << 20, "largest request body (more: 413)")
    max_inputs: int = option(2048, "inputs (prompts, documents) in one request (more: 400)")
    max_input_chars: int = option(
        DEFAULT_MAX_INPUT_CHARS, "characters in one input text (more: 400)"
    )
    max_image_pixels: int = option(
        DEFAULT_MAX_IMAGE_PIXELS, "pixels (width x height) of one input image (more: 400)"
    )
    allowed_local_media_path: str | None = option(
        None, "read file:// image URLs under this folder", shown="none: file:// is refused"
    )
    allow_remote_media: bool = option(
        False, "accept http(s) image URLs (this server fetches nothing: they are still refused)"
    )
    max_request_tokens: int = option(
        65536, "prompt tokens of one request, all its inputs together (more: 400)"
    )
    max_response_values: int = option(
        1 << 22,
        "numbers in one response: token_embed tokens x size, prompt tokens x (prompt_logprobs "
        "+ 1) (more: 400)",
    )
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral"] = option(
        "auto",
        "how the model writes tool calls, parsed out of chat completions; auto: read from the "
        "chat template (<tool_call>: hermes, [TOOL_CALLS]: mistral, <|python_tag|>: "
        "llama3_json; none found: calls are not parsed)",
    )
    reasoning_parser: Literal["none", "qwen3", "deepseek_r1"] = option(
        "none",
        "split the model's <think>...</think> into reasoning_content (qwen3: when the output "
        "opens with <think>; deepseek_r1: all until </think>, the template opens it)",
    )
    max_stop_strings: int = option(
        64, "stop strings, and stop token ids, in one generation request (more: 400)"
    )
    max_stop_chars: int = option(
        4096, "characters of one generation request's stop strings together (more: 400)"
    )
    max_request_generated_tokens: int = option(
        1 << 18,
        "tokens one generation request may ask for, prompts x n x max_tokens (more: 400)",
    )
    default_max_tokens: int = option(
        4096,
        "max_tokens of a chat completion that does not set it (at most what the context has "
        "left; completions default to 16, as OpenAI's)",
    )
    max_waiting_requests: int = option(
        4096, "requests queued beyond --max-num-seqs before answering 429"
    )
    auto_truncate: bool = option(
        False,
        "embedding routes cut inputs longer than the model's limit instead of refusing them",
    )
    read_timeout: float = option(
        30.0, "seconds a client has to send a whole request (headers and body); slower: closed"
    )
    keep_alive_timeout: float = option(5.0, "seconds an idle keep-alive connection is kept open")
    max_connections: int = option(
        1024,
        "connections with a request in progress at once (idle ones do not count); more are "
        "answered 503, but /health and /metrics always",
    )
    engine_heartbeat_timeout: float = option(
        30.0, "seconds without a word from the engine core before /health reports it hung"
    )
    data_parallel_size: int = option(
        1,
        "engine-core processes, each on its own share of the cores; requests go to the least "
        "loaded (generation: the one holding the prompt's prefix)",
    )
    distributed_executor: Literal["process", "ray"] = option(
        "process",
        "engine cores as local processes, or as Ray actors on a cluster (zmq over TCP)",
    )
    ray_address: str | None = option(
        None,
        "the Ray cluster for --distributed-executor ray",
        shown="RAY_ADDRESS, else a local Ray instance",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = option(
        "info", "log level of the server and the engine core", parse=str.lower
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "send an OpenTelemetry trace of every request (spans: tokenize, queue, prefill, decode "
        "or pool, respond) to this OTLP collector, e.g. http://localhost:4317 (gRPC; set "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for OTLP over HTTP); needs "
        "pip install 'cenote[otel]'",
        shown="none (no tracing)",
    )
    log_requests: bool = option(
        False,
        "log one line per API request: id, model, route, task, tokens, status and latency "
        "(the prompt only as its length, see --log-requests-max-chars)",
    )
    log_requests_max_chars: int = option(
        0,
        "with --log-requests, also show this many characters of the first input's text",
        shown="0 (never the text)",
        parse=_non_negative_int,
    )
    first_byte_timeout: float = option(
        5.0, "seconds a new connection has to send its first byte; silent: closed"
    )
    max_connections_per_client: int = option(
        256,
        "open connections (idle too) from one client address; more are answered 503 and "
        "closed at once (behind a load balancer, all come from its address)",
    )
    embedding_cache_size: CacheSize = option(
        CacheSize(),
        "an exact cache of pooling results (embeddings, classification and score outputs; "
        "not token-level ones) in the front: a number of entries (10000) or bytes (512MiB, "
        "2GB); a repeated input is answered without the engine",
        shown="0 (off)",
        parse=parse_cache_size,
    )
    long_input: Literal["error", "chunk"] = option(
        "error",
        "embeddings of texts longer than the model's window: error (400), or chunk (windows of "
        "max_model_len joined into one embedding; requests may choose with long_input)",
    )
    chunk_overlap: int = option(0, "tokens neighbouring windows share when long inputs chunk")
    input_type_prompts: dict[str, str] | None = option(
        None,
        "POST /v2/embed (Cohere): a JSON object of input_type -> instruction prompt, e.g. "
        '\'{"search_query": "query: ", "search_document": "passage: "}\'',
        shown="the model's prompts named query, document / passage / corpus, classification, "
        "clustering",
        parse=parse_input_type_prompts,
    )
    enable_lora_runtime_updating: bool = option(
        False,
        "mount POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): LoRA adapters "
        "served by name are added and removed while the server runs",
    )
    models_dir: str | None = option(
        None,
        "serve every model folder (with a config.json) and .gguf file directly under this "
        "folder by its name (folder name, file name without .gguf), loaded by its first request",
        shown="none",
    )
    max_loaded_models: int | None = option(
        None,
        "--models-dir models loaded at once; loading one more first unloads the least recently "
        "used idle one (when all are busy, the load waits, up to --model-load-timeout)",
        shown="no bound",
    )
    idle_unload_seconds: float | None = option(
        None,
        "unload a --models-dir model that has had no request for this many seconds",
        shown="never",
    )
    model_load_timeout: float = option(
        300.0,
        "seconds a request waits for its --models-dir model to load (longer: 503; the load "
        "goes on)",
    )
    batch_dir: str | None = option(
        None,
        "turn the OpenAI Batch API on (/v1/files, /v1/batches): files, batches and every "
        "finished line kept in this folder (SQLite), unfinished batches resumed at start; the "
        "engines then schedule by priority, batch lines after interactive requests",
        shown="none (the Batch API is off)",
    )
    max_batch_file_bytes: int = option(
        200 << 20, "bytes of one uploaded batch file (more: 413)", parse=parse_bytes
    )
    max_batch_lines: int = option(50_000, "lines (requests) of one batch file (more: 400)")
    batch_concurrency: int = option(
        4, "lines of a running batch sent to the engines at once (each at batch priority)"
    )
    # not command-line options
    engine_dead_exit_delay_s: float = 2.0  # keep answering 503 this long before exiting
    blocking_threads: int = 2  # threads for tokenization, chat templates and big JSON bodies


class ServerState:
    """One served model: its engine client, tokenizer, input processor, options and metrics
    (``served_models.ServedModels`` holds every model of a server)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        options: ServerOptions,
        metric_families: MetricFamilies | None = None,  # the server's registry; None: its own
    ) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model
        self.options = options
        self.model_name = self.model_config.served_model_name
        self.metrics = ServerMetrics(self.model_name, metric_families)
        self.tokenizer = load_tokenizer(self.model_config)
        self.client: AsyncEngineClient | DataParallelEngineClient
        if options.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {options.data_parallel_size}")
        if options.data_parallel_size > 1:
            self.client = DataParallelEngineClient(
                engine_config, self.tokenizer, options.data_parallel_size,
                on_step=self.metrics.record_step, on_dead=self._on_dead,
                executor=options.distributed_executor, ray_address=options.ray_address,
            )  # fmt: skip
        else:
            self.client = AsyncEngineClient(
                engine_config, self.tokenizer, on_step=self.metrics.record_step,
                on_dead=self._on_dead, executor=options.distributed_executor,
                ray_address=options.ray_address,
            )  # fmt: skip
        self.input_processor: InputProcessor | None = None  # set once the core is ready
        size = options.embedding_cache_size
        # in the front: a hit takes no IPC, no scheduler slot, and serves every data-parallel core
        self.embedding_cache = EmbeddingCache(size, self.model_name) if size.enabled else None
        self.tool_format: ToolCallFormat | None = None  # set with the input processor
        self.reasoning_format = reasoning_format(options.reasoning_parser)
        self.on_engine_dead: Callable[[str], None] | None = None
        # LoRA adapters served by name (--lora-modules, then POST /v1/load_lora_adapter); each
        # load takes a new id, never reused: the engine's resident copies and the caches key on it
        self.adapters = {m.lora_name: m for m in engine_config.lora.modules}
        self._next_lora_id = 1 + max((m.lora_int_id for m in self.adapters.values()), default=0)
        self._shape_checker: LoRAManager | None = None  # built by the first runtime load
        # CPU-bound work of a request runs here, never on the event loop
        self._blocking = ThreadPoolExecutor(options.blocking_threads, "cenote-front")

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` (tokenization, templates, JSON of a large body) off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._blocking, functools.partial(fn, *args, **kwargs))

    def check_request_tokens(self, num_tokens: int) -> None:
        """One request may not hold the engine: its inputs together have a token bound."""
        limit = self.options.max_request_tokens
        if num_tokens > limit:
            raise BadRequest(
                f"the request's inputs have {num_tokens} tokens together, more than this "
                f"server's limit of {limit} per request (--max-request-tokens); split it"
            )

    def check_response_values(self, num_values: int, what: str) -> None:
        """A response may not be arbitrarily larger than its request (token-level outputs)."""
        limit = self.options.max_response_values
        if num_values > limit:
            raise BadRequest(
                f"the response would hold {num_values} numbers ({what}), more than this server's "
                f"limit of {limit} per response (--max-response-values); send fewer or shorter "
                "inputs per request"
            )

    @property
    def media_policy(self) -> MediaPolicy:
        """How images may arrive in requests (``image_url`` content parts)."""
        folder = self.options.allowed_local_media_path
        return MediaPolicy(
            max_image_pixels=self.options.max_image_pixels,
            allowed_local_media_path=Path(folder) if folder is not None else None,
            allow_remote_media=self.options.allow_remote_media,
        )

    async def start(self) -> None:
        capabilities = await self.client.start()
        self.input_processor = InputProcessor(
            self.model_config, self.tokenizer, capabilities, self.options.chat_template,
            max_input_chars=self.options.max_input_chars, media_policy=self.media_policy,
        )  # fmt: skip
        template = self.input_processor.chat_template
        self.tool_format = tool_call_format(self.options.tool_call_parser, template)

    async def close(self) -> None:
        """Shut the engine cores down (they exit) and the front's worker threads."""
        await self.client.shutdown()
        self._blocking.shutdown(wait=False)

    def _on_dead(self, reason: str) -> None:
        if self.on_engine_dead is not None:
            self.on_engine_dead(reason)

    @property
    def ready(self) -> bool:
        return self.input_processor is not None and self.client.dead_reason is None

    def health_problem(self) -> dict[str, Any] | None:
        """Why this model does not serve fully (its ``/health`` entry), or None."""
        reason = self.client.dead_reason
        if not self.ready:
            return {"status": "dead" if reason else "starting", "reason": reason or "starting"}
        silent, limit = self.client.silent_for, self.options.engine_heartbeat_timeout
        if silent > limit:  # a core stopped (SIGSTOP) or stuck sends neither outputs nor heartbeats
            return {
                "status": "hung",
                "reason": f"the engine core has sent nothing for {silent:.1f} s (limit "
                f"{limit:g} s): it is hung",
            }
        dead = self.client.dead_cores  # data parallel: some cores may be gone, others serve
        if dead:
            reasons = {str(rank): why for rank, why in dead.items()}
            return {"status": "degraded", "dead_engines": reasons}
        return None

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        caps = self.client.capabilities
        return caps.supported_tasks if caps is not None else ()

    # ---- checks shared by routes ------------------------------------------------------------

    def processor(self) -> InputProcessor:
        if self.client.dead_reason is not None:
            raise Unavailable(f"the engine is not running: {self.client.dead_reason}")
        if self.input_processor is None:
            raise Unavailable("the server is starting; the model is not loaded yet")
        return self.input_processor

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404 for a
        name that is neither the base model nor a served adapter."""
        if model is None or model == self.model_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            names = [self.model_name, *self.adapters]
            raise ModelNotFound(
                f"the model {model!r:.200} does not exist; this server serves "
                f"{', '.join(repr(n) for n in names)}",
                param="model",
            )
        return adapter

    def echoed_model(self, model: str | None) -> str:
        """The ``model`` a response echoes: the name the request gave (this model's, or one of
        its adapters': ``check_model`` refused any other), as vLLM echoes an adapter's name;
        this model's when the request named none."""
        return self.model_name if model is None else model

    # ---- LoRA adapters added and removed at run time ------------------------------------------

    async def load_adapter(self, name: str, path: str) -> LoRARequest:
        """Serve the PEFT adapter folder ``path`` as ``name``: read and checked against this
        base (rank, every projection's shape) off the event loop, then usable in ``model``.
        The engine cores read it at its first request, as they do ``--lora-modules``'.
        404 when ``path`` is no folder (vLLM: "No adapter found"), 400 naming the problem."""
        if not Path(path).is_dir():
            raise ModelNotFound(
                f"no LoRA adapter found at {path!r:.300}: not a folder", param="lora_path"
            )
        request = LoRARequest(name, self._next_lora_id, path)
        try:
            await self.offload(self._check_adapter, request)
        except ValueError as error:
            raise BadRequest(
                f"cannot load LoRA adapter {name!r:.200}: {error}", param="lora_path"
            ) from None
        if name in self.adapters:  # a load of the same name finished while this one was checked
            raise BadRequest(
                f"the LoRA adapter {name!r:.200} has already been loaded", param="lora_name"
            )
        self._next_lora_id += 1
        self.adapters[name] = request
        logger.info("LoRA adapter %r loaded from %s on %r", name, path, self.model_name)
        return request

    def _check_adapter(self, request: LoRARequest) -> None:
        if self._shape_checker is None:
            self._shape_checker = shape_checker(
                self.model_config, self.engine_config.lora.max_lora_rank
            )
        self._shape_checker.check(request)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests naming it get 404; requests already
        running under it finish under it (the engine keeps an adapter a request holds, and
        evicts it, least recently used, once none does)."""
        if self.adapters.pop(name, None) is None:
            raise ModelNotFound(
                f"the LoRA adapter {name!r:.200} cannot be found; loaded: "
                f"{', '.join(repr(n) for n in self.adapters) or 'none'}",
                param="lora_name",
            )
        logger.info("LoRA adapter %r unloaded from %r", name, self.model_name)

    def check_capacity(self, num_new: int) -> None:
        """429 when the requests beyond ``max_num_seqs`` would pass ``max_waiting_requests``."""
        in_flight = self.client.num_unfinished
        max_running = self.engine_config.scheduler.max_num_seqs
        waiting = in_flight + num_new - max_running
        if waiting > self.options.max_waiting_requests:
            raise Overloaded(
                f"the server is overloaded: {in_flight} requests in flight, {num_new} more would "
                f"exceed {max_running} running + {self.options.max_waiting_requests} waiting",
                headers={"Retry-After": "1"},
            )

    def check_prompts(self, prompts: list[PromptType]) -> None:
        """At most ``max_inputs`` inputs (the input processor holds each text, chats once
        rendered, to ``max_input_chars``)."""
        limit = self.options.max_inputs
        if len(prompts) > limit:
            raise BadRequest(
                f"got {len(prompts)} inputs, the limit per request is {limit}", param="input"
            )

    def check_texts(self, texts: Sequence[object], param: str) -> None:
        """Scoring inputs: at most ``max_inputs`` inputs, texts of at most ``max_input_chars``
        each (images are held to ``max_image_pixels`` where they are opened)."""
        limit, char_limit = self.options.max_inputs, self.options.max_input_chars
        if len(texts) > limit:
            raise BadRequest(
                f"got {len(texts)} texts in {param}, the limit per request is {limit}", param
            )
        for i, text in enumerate(texts):
            if isinstance(text, str) and len(text) > char_limit:
                raise BadRequest(
                    f"{param}[{i}] has {len(text)} characters, the limit is {char_limit}", param
                )

    # ---- running ------------------------------------------------------------------------------

    async def run_pooling(
        self, requests: list[ParentRequest], task: str
    ) -> list[PoolingRequestOutput[Any]]:
        """Run pooling requests in the core (those the embedding cache does not answer), in
        order; records latency and prompt tokens (cached ones too, as ``usage`` counts them),
        the request's ``task`` the label of its per-task metrics (``score`` for scoring)."""
        started = time.monotonic()
        cache = self.embedding_cache
        if cache is None:
            outputs = outputs_of(PoolingRequestOutput, await run_async(self.client, requests))
        else:
            lookup = cache.lookup(requests)
            computed = await run_async(self.client, lookup.misses) if lookup.misses else []
            outputs = cache.complete(lookup, outputs_of(PoolingRequestOutput, computed))
            self.metrics.record_cache(lookup.num_hits, lookup.num_misses, cache)
        finished = time.monotonic()
        self.metrics.ttft.observe(finished - started)
        self.metrics.e2e.observe(finished - started)
        num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        self.metrics.prompt_tokens.inc(float(num_tokens))
        timing.record_requests(requests)
        run = timing.EngineRun(self.model_name, task, self.model_config.device, started, finished)
        timing.record_outputs([out.metrics for out in outputs], num_tokens, run)
        return outputs


def new_request_id(prefix: str, given: str | None = None) -> str:
    return given or f"{prefix}-{uuid.uuid4().hex}"


def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Cancel a non-streaming handler when its client disconnects (its requests get aborted)."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        request: Request = kwargs["raw_request"]
        handler_task = asyncio.ensure_future(handler(*args, **kwargs))
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait(
                {handler_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:  # the caller went away (a cancelled batch line)
            handler_task.cancel()
            disconnect_task.cancel()
            raise
        if handler_task in done:
            disconnect_task.cancel()
            return handler_task.result()
        handler_task.cancel()
        logger.info("client disconnected; request aborted")
        try:
            await handler_task
        except asyncio.CancelledError:
            pass
        return None

    return wrapper


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
