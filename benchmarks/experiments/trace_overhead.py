"""What observing one request costs the server's front, per request, once its response is sent
(``FrontDoor._observe``): the per-task metrics (always on), the ``--log-requests`` line (built,
not written), and with ``--otlp-traces-endpoint`` the trace (a root and five child spans handed
to the SDK's ``BatchSpanProcessor``; its exporter here drops them, so the OTLP encoding and
sending, which run on the processor's own thread, are not counted).

    flock /tmp/cpu_bench.lock .venv/bin/python -m benchmarks.experiments.trace_overhead --requests 20000
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from benchmarks.common import cpu_banner
from cenote.server.metrics import MetricFamilies
from cenote.server.request_log import request_line
from cenote.server.timing import RequestTimings
from cenote.server.tracing import RequestTracer

HEADERS = [(b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]


class DroppingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def generation_timings() -> RequestTimings:
    """A finished completion's record, as the routes fill it."""
    now = time.monotonic()
    timings = RequestTimings(started=now - 0.05, model="chat", task="generate", request_id="cmpl-1")
    timings.tokenization_started, timings.tokenization_finished = now - 0.049, now - 0.048
    timings.engine_started, timings.engine_finished = now - 0.047, now - 0.001
    timings.queue_seconds, timings.inference_seconds = 0.002, 0.04
    timings.first_token_time = now - 0.03
    timings.num_tokens, timings.num_output_tokens, timings.ran = 12, 16, True
    timings.first_prompt = "a prompt of some length " * 4
    return timings


def per_call_us(fn: Callable[[], None], num_calls: int) -> float:
    for _ in range(min(num_calls, 1000)):  # warm up
        fn()
    started = time.perf_counter()
    for _ in range(num_calls):
        fn()
    return (time.perf_counter() - started) / num_calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    timings = generation_timings()
    families = MetricFamilies()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(DroppingExporter(), max_queue_size=1 << 16))
    tracer = RequestTracer(provider)
    n = args.requests
    results = {
        "per-task metrics (always)": per_call_us(
            lambda: families.record_task("chat", "generate", 12, 0.05), n
        ),
        "log line, built (--log-requests)": per_call_us(
            lambda: request_line("POST", "/v1/completions", 200, 0.05, timings, 0) and None, n
        ),
        "trace, 6 spans (--otlp-traces-endpoint)": per_call_us(
            lambda: tracer.trace(HEADERS, "POST", "/v1/completions", 200, timings), n
        ),
    }
    provider.shutdown()
    print(f"{cpu_banner()}; {n} requests each, one thread")
    for what, us in results.items():
        print(f"  {what:42s} {us:8.1f} us per request")


if __name__ == "__main__":
    main()
