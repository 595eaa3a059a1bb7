"""OpenTelemetry traces of HTTP requests (``--otlp-traces-endpoint``).

Nothing here runs per request while tracing is off: ``opentelemetry`` is imported only by
``RequestTracer.to_endpoint``, and the front door asks for a trace only when it holds a tracer.
The spans are built after the response is sent, from the moments the request's
``RequestTimings`` recorded (cenote/server/timing.py), with explicit start and end times; the
engine loop is not instrumented. One trace per request:

- ``{METHOD} {route}`` (server span, the root): front door to the response's last byte, child
  of the caller's span when the request carries a W3C ``traceparent`` header; attributes
  ``cenote.request_id``, ``gen_ai.request.model``, ``cenote.task``,
  ``gen_ai.usage.input_tokens`` (prompt tokens), ``gen_ai.usage.output_tokens`` (generated),
  ``http.request.method``, ``http.route``, ``http.response.status_code``; status ERROR on a 5xx;
- its children, in order: ``tokenize`` (validation, templates, tokenization), ``queue``
  (waiting in the scheduler), then ``prefill`` and ``decode`` (generation: until the first
  token, then the rest) or ``pool`` (pooling), then ``respond`` (from the last engine output to
  the response's last byte: building and sending the answer; a stream's last chunks).

Detokenization runs in the front as each step's tokens arrive, interleaved with decoding, so
it lies inside ``decode`` and has no span of its own. The engine core measures queue and
inference times on its own clock (clocks are never compared across processes); their spans
start when the front handed the request to the engine client, last what the core measured
(averaged over a request's inputs, as the ``x-queue-time`` / ``x-inference-time`` headers),
and are cut at the moment the last output came back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cenote.server.timing import RequestTimings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer


@dataclass(frozen=True)
class Phase:
    """One child span: a named interval on this process's monotonic clock."""

    name: str
    start: float
    end: float


def request_phases(timings: RequestTimings, finished: float) -> list[Phase]:
    """The child spans of a request that ended (its response sent) at ``finished``."""
    phases = []
    if timings.tokenization_started is not None and timings.tokenization_finished is not None:
        phases.append(
            Phase("tokenize", timings.tokenization_started, timings.tokenization_finished)
        )
    started, returned = timings.engine_started, timings.engine_finished
    if started is None or returned is None:
        return phases
    queued_until = min(started + timings.queue_seconds, returned)
    ran_until = min(queued_until + timings.inference_seconds, returned)
    phases.append(Phase("queue", started, queued_until))
    if timings.task == "generate":
        first_token = timings.first_token_time
        first_token = ran_until if first_token is None else first_token
        first_token = min(max(first_token, queued_until), ran_until)
        phases.append(Phase("prefill", queued_until, first_token))
        phases.append(Phase("decode", first_token, ran_until))
    else:
        phases.append(Phase("pool", queued_until, ran_until))
    phases.append(Phase("respond", returned, max(finished, returned)))
    return phases


class RequestTracer:
    """Turns a finished request's timings into spans on an OpenTelemetry tracer provider."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        import cenote

        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("cenote", cenote.__version__)
        self.propagator = TraceContextTextMapPropagator()  # W3C traceparent / tracestate

    @classmethod
    def to_endpoint(cls, endpoint: str) -> RequestTracer:
        """Spans batched to the OTLP collector at ``endpoint`` (gRPC, or HTTP when
        ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` is ``http/protobuf``: then ``endpoint`` is the
        whole URL, ``.../v1/traces``); service name ``cenote``
        unless ``OTEL_SERVICE_NAME`` says otherwise. A ValueError naming the extra to install
        when the OpenTelemetry packages are missing."""
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            exporter = _exporter(protocol, endpoint)
        except ImportError as error:
            raise ValueError(
                f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter "
                f"({error.name} is not installed): pip install 'cenote[otel]'"
            ) from None
        service = os.environ.get("OTEL_SERVICE_NAME", "cenote")
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    def trace(
        self,
        headers: Sequence[tuple[bytes, bytes]],
        method: str,
        route: str,
        status: int,
        timings: RequestTimings,
    ) -> None:
        """Record the request whose response was just sent (``headers``: the request's, ASGI)."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        finished = time.monotonic()
        clock = _WallClock(finished)
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name in (b"traceparent", b"tracestate")
        }
        parent = self.propagator.extract(carrier) if carrier else None
        root = self.tracer.start_span(
            f"{method} {route}", context=parent, kind=SpanKind.SERVER,
            start_time=clock.ns(timings.started), attributes=_attributes(method, route, status, timings),
        )  # fmt: skip
        if status >= 500:
            root.set_status(Status(StatusCode.ERROR))
        inside = trace.set_span_in_context(root)
        for phase in request_phases(timings, finished):
            span = self.tracer.start_span(
                phase.name, context=inside, start_time=clock.ns(phase.start)
            )
            span.end(end_time=clock.ns(phase.end))
        root.end(end_time=clock.ns(finished))

    def shutdown(self) -> None:
        """Send the spans still batched, then stop the exporter."""
        self.provider.shutdown()


class _WallClock:
    """Monotonic moments of this process as Unix nanoseconds (what OpenTelemetry records)."""

    def __init__(self, now: float) -> None:
        self.now, self.now_ns = now, time.time_ns()

    def ns(self, moment: float) -> int:
        return self.now_ns - int((self.now - moment) * 1e9)


def _attributes(method: str, route: str, status: int, timings: RequestTimings) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "http.request.method": method,
        "http.route": route,
        "http.response.status_code": status,
    }
    optional = {
        # a client's request_id is echoed as given: cut, as the log line cuts it
        "cenote.request_id": None if timings.request_id is None else timings.request_id[:128],
        "gen_ai.request.model": timings.model,
        "cenote.task": timings.task,
    }
    attributes.update({name: value for name, value in optional.items() if value is not None})
    if timings.ran:
        attributes["gen_ai.usage.input_tokens"] = timings.num_tokens
        attributes["gen_ai.usage.output_tokens"] = timings.num_output_tokens
    return attributes


def _exporter(protocol: str, endpoint: str) -> Any:
    """The OTLP span exporter for ``protocol`` (``grpc`` or ``http/protobuf``)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        return HTTPSpanExporter(endpoint=endpoint)
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is {protocol!r}; cenote sends 'grpc' or "
        "'http/protobuf'"
    )
