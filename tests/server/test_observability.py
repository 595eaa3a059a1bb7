"""Observability of the server: OpenTelemetry traces (spans recorded by the SDK's own
``InMemorySpanExporter``: names, parents, W3C ``traceparent`` propagation, attributes), per-task
metrics on ``/metrics`` (read with prometheus_client's own parser) and the ``--log-requests``
line. One in-process front (the engine cores are their own processes) serves an embedder and a
tiny Llama, so one start-up covers pooling, scoring and generation."""

from __future__ import annotations

import http.server
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories.decoders import make_decoder
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from server_fixture import ServerProcess, free_port, wait_until
from starlette.testclient import TestClient

from cenote.engine_args import EngineArgs
from cenote.server.app import build_app
from cenote.server.metrics import MetricFamilies
from cenote.server.request_log import request_line
from cenote.server.served_models import ServedModels
from cenote.server.state import ServerOptions, ServerState
from cenote.server.timing import RequestTimings
from cenote.server.tracing import RequestTracer, request_phases

LOG_MAX_CHARS = 8
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"  # the W3C Trace Context specification's example
CALLER_SPAN_ID = "00f067aa0ba902b7"
POOLING_SPANS = ["tokenize", "queue", "pool", "respond"]
GENERATION_SPANS = ["tokenize", "queue", "prefill", "decode", "respond"]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def client(tmp_path_factory, minilm_path: Path, exporter: InMemorySpanExporter):
    """``embedder`` (all-MiniLM-L6-v2) and ``chat`` (a tiny random Llama), one thread each,
    ``--log-requests --log-requests-max-chars 8``, traced to ``exporter``."""
    chat_folder = tmp_path_factory.mktemp("observed_llama")
    make_decoder(chat_folder, "llama")
    options = ServerOptions(log_requests=True, log_requests_max_chars=LOG_MAX_CHARS)
    families = MetricFamilies()
    states = []
    for name, path in (("embedder", minilm_path), ("chat", chat_folder)):
        engine = {"dtype": "float32", "num_threads": 1, "served_model_name": name}
        config = EngineArgs.from_options(str(path), engine).create_engine_config()
        states.append(ServerState(config, options, families))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = build_app(ServedModels(states, options, families), RequestTracer(provider))
    with TestClient(app) as test_client:
        deadline = time.monotonic() + 120
        while test_client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engines did not start in 120 s"
            time.sleep(0.1)
        yield test_client


def _trace(exporter: InMemorySpanExporter, send) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The root span and its children (in start order) of the one request ``send`` makes."""
    exporter.clear()
    send()
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(roots) == 1, [s.name for s in spans]
    root = roots[0]
    children = sorted((s for s in spans if s is not root), key=lambda s: s.start_time or 0)
    for child in children:
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    return root, children


def test_an_embedding_request_is_one_trace_under_the_callers_span(client, exporter) -> None:
    traceparent = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
    answers = []

    def send() -> None:
        body = {"input": ["traced text", "another traced text"], "model": "embedder"}
        answers.append(
            client.post("/v1/embeddings", json=body, headers={"traceparent": traceparent})
        )

    root, children = _trace(exporter, send)
    answer = answers[0]
    assert answer.status_code == 200, answer.text
    assert root.name == "POST /v1/embeddings"
    assert format(root.context.trace_id, "032x") == TRACE_ID  # the caller's trace
    assert root.parent is not None and format(root.parent.span_id, "016x") == CALLER_SPAN_ID
    assert [c.name for c in children] == POOLING_SPANS
    attributes = dict(root.attributes or {})
    assert attributes["cenote.request_id"] == answer.json()["id"]
    assert attributes["gen_ai.request.model"] == "embedder"
    assert attributes["cenote.task"] == "embed"
    assert attributes["gen_ai.usage.input_tokens"] == answer.json()["usage"]["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == 0
    assert attributes["http.response.status_code"] == 200


def test_a_completion_has_prefill_and_decode_spans(client, exporter) -> None:
    answers = []

    def send() -> None:
        body = {"model": "chat", "prompt": "w5 w6 w7", "max_tokens": 5, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        answers.append(client.post("/v1/completions", json=body))

    root, children = _trace(exporter, send)
    assert answers[0].status_code == 200, answers[0].text
    usage = answers[0].json()["usage"]
    assert root.name == "POST /v1/completions" and root.parent is None  # no traceparent sent
    assert [c.name for c in children] == GENERATION_SPANS
    attributes = dict(root.attributes or {})
    assert attributes["cenote.task"] == "generate"
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] == 3
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5


def test_a_streamed_completion_is_traced_to_its_last_chunk(client, exporter) -> None:
    def send() -> None:
        body = {"model": "chat", "prompt": "w5", "max_tokens": 3, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with client.stream("POST", "/v1/completions", json=body) as streamed:
            assert streamed.status_code == 200
            streamed.read()

    root, children = _trace(exporter, send)
    assert [c.name for c in children] == GENERATION_SPANS
    assert dict(root.attributes or {})["gen_ai.usage.output_tokens"] == 3


def test_a_refused_request_is_a_root_span_without_engine_children(client, exporter) -> None:
    root, children = _trace(
        exporter, lambda: client.post("/v1/embeddings", json={"input": [], "model": "embedder"})
    )
    assert dict(root.attributes or {})["http.response.status_code"] == 400
    assert "queue" not in [c.name for c in children]


def _samples(client) -> dict[tuple[str, str, str], float]:
    """(sample name, model, task) -> value of the per-task series on /metrics."""
    text = client.get("/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "task" in sample.labels:
                key = (sample.name, sample.labels["model_name"], sample.labels["task"])
                values[key] = sample.value
    return values


def test_per_task_metrics_count_requests_tokens_and_latency(client) -> None:
    before = _samples(client)
    embedded = client.post("/v1/embeddings", json={"input": ["a b c", "d e"], "model": "embedder"})
    scored = client.post(
        "/score", json={"model": "embedder", "text_1": "a query", "text_2": ["one", "two"]}
    )
    completed = client.post(
        "/v1/completions", json={"model": "chat", "prompt": "w5 w6", "max_tokens": 2}
    )
    refused = client.post("/v1/embeddings", json={"input": [], "model": "embedder"})
    assert [embedded.status_code, scored.status_code, completed.status_code] == [200, 200, 200]
    assert refused.status_code == 400
    after = _samples(client)

    def grew(name: str, model: str, task: str) -> float:
        return after.get((name, model, task), 0.0) - before.get((name, model, task), 0.0)

    for model, task, answer in (
        ("embedder", "embed", embedded), ("embedder", "score", scored), ("chat", "generate", completed),
    ):  # fmt: skip
        assert grew("cenote_task_requests_total", model, task) == 1  # the 400 is not counted
        assert grew("cenote_task_request_latency_seconds_count", model, task) == 1
        assert grew("cenote_task_request_latency_seconds_sum", model, task) > 0
        prompt_tokens = answer.json()["usage"]["prompt_tokens"]
        assert grew("cenote_task_prompt_tokens_total", model, task) == prompt_tokens
    assert ("cenote_task_requests_total", "chat", "embed") not in after


def test_log_requests_writes_one_bounded_line_per_request(client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="cenote.requests")
    text = "a secret\nprompt that must not be logged whole"
    answer = client.post("/v1/embeddings", json={"input": text, "model": "embedder"})
    client.post("/v1/embeddings", json={"input": [], "model": "embedder"})
    client.get("/health")  # GETs are not logged
    lines = [r.getMessage() for r in caplog.records if r.name == "cenote.requests"]
    assert len(lines) == 2, lines
    line, refused = lines
    tokens = answer.json()["usage"]["prompt_tokens"]
    assert line.startswith(f"request '{answer.json()['id']}' model='embedder' ")
    for field in ("method=POST", "route=/v1/embeddings", "task=embed", "status=200",
                  f"prompt_tokens={tokens}", "output_tokens=0", "inputs=1", f"chars={len(text)}"):  # fmt: skip
        assert field in line.split(" "), (field, line)
    assert line.endswith(f"prompt={text[:LOG_MAX_CHARS]!r}...")  # "a secret", then cut
    assert "\n" not in line and "prompt that" not in line
    assert "status=400" in refused and "task=-" in refused and "latency_ms=" in refused


def test_the_log_line_never_shows_the_text_by_default() -> None:
    timings = RequestTimings(request_id="x\n" * 200, model="m", task="embed", num_inputs=1)
    timings.first_prompt = "private text"
    line = request_line("POST", "/v1/embeddings", 200, 0.01, timings, max_chars=0)
    assert "private" not in line and "prompt=" not in line
    assert "\n" not in line and len(line) < 400  # a client's request id is cut and escaped


def test_phases_place_the_cores_durations_after_the_front_sent_the_request() -> None:
    """Queue and inference as the core measured them, cut at the last output's arrival."""
    timings = RequestTimings(started=10.0, task="generate")
    timings.tokenization_started, timings.tokenization_finished = 10.0, 10.5
    timings.engine_started, timings.engine_finished = 11.0, 14.0
    timings.queue_seconds, timings.inference_seconds = 1.0, 5.0  # runs past the last output
    timings.first_token_time = 12.5
    phases = [(p.name, p.start, p.end) for p in request_phases(timings, finished=15.0)]
    assert phases == [
        ("tokenize", 10.0, 10.5), ("queue", 11.0, 12.0), ("prefill", 12.0, 12.5),
        ("decode", 12.5, 14.0), ("respond", 14.0, 15.0),
    ]  # fmt: skip


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip


def test_tracing_off_imports_no_opentelemetry_sdk() -> None:
    """fastapi itself imports the OpenTelemetry API; cenote imports nothing more unless asked."""
    result = _python(
        "import sys\n"
        "import cenote.cli.main, cenote.server.app\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter'))))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_flag_without_the_extra_is_a_clear_start_up_error() -> None:
    """Before any model loads: exit 2 naming the extra to install."""
    result = _python(
        "import sys\n"
        "sys.modules['opentelemetry.sdk.trace'] = None  # as if cenote[otel] were not installed\n"
        "from cenote.cli.main import main\n"
        f"main(['serve', '--otlp-traces-endpoint', 'http://127.0.0.1:4317', '--port', "
        f"'{free_port()}'])"
    )
    assert result.returncode == 2, result.stderr
    assert "--otlp-traces-endpoint needs the OpenTelemetry SDK" in result.stderr
    assert "pip install 'cenote[otel]'" in result.stderr


def test_a_negative_log_requests_max_chars_is_refused(capsys) -> None:
    from cenote.cli import main as cli

    with pytest.raises(SystemExit) as exited:
        cli._parser().parse_args(["serve", "--log-requests-max-chars", "-1"])
    assert exited.value.code == 2
    assert "--log-requests-max-chars: expected 0 or more, got -1" in capsys.readouterr().err


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace collector: keeps each export request's decoded spans."""

    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args) -> None:
        pass


def test_cenote_serve_exports_spans_over_otlp_and_logs_requests(monkeypatch) -> None:
    """The real command: spans reach an OTLP/HTTP collector as the exporter sends them (decoded
    with OpenTelemetry's own protobuf classes), the log line reaches the server's log."""
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: export soon after the request
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    server = ServerProcess(
        "--dtype", "float32", "--num-threads", "1", "--otlp-traces-endpoint", endpoint,
        "--log-requests",
    )  # fmt: skip
    try:
        answer = httpx.post(f"{server.url}/v1/embeddings", json={"input": "exported"}, timeout=60)
        assert answer.status_code == 200, answer.text

        def spans() -> dict[str, Any]:
            return {
                span.name: span
                for request in _Collector.received
                for resource in request.resource_spans
                for scope in resource.scope_spans
                for span in scope.spans
            }

        wait_until(lambda: "respond" in spans(), "exported spans", timeout_s=30)
        by_name = spans()
        root = by_name["POST /v1/embeddings"]
        assert {name for name in by_name} >= {"POST /v1/embeddings", *POOLING_SPANS}
        for name in POOLING_SPANS:
            assert by_name[name].parent_span_id == root.span_id
        attributes = {a.key: a.value for a in root.attributes}
        assert attributes["cenote.request_id"].string_value == answer.json()["id"]
        wait_until(lambda: f"request '{answer.json()['id']}'" in server.log(), "the log line")
        assert "exported" not in server.log()  # the text is never logged by default
    finally:
        server.stop()
        collector.shutdown()
