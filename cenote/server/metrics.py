"""Prometheus metrics of one server: its own registry (tests start many servers), every
per-model series labelled with the model's served name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cenote.engine.embedding_cache import EmbeddingCache
from cenote.messages import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384)


class MetricFamilies:
    """The server's one registry: the HTTP counter (by endpoint and status: the front door sees
    the route, not the body's model) and every per-model series, labelled ``model_name``."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, ["model_name"], registry=r)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, ["model_name"], registry=r)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, ["model_name"], buckets=buckets, registry=r)

        self.requests = Counter(
            "cenote_http_requests", "HTTP requests by endpoint and status",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.num_waiting = gauge("cenote_num_requests_waiting", "Requests waiting in the scheduler")
        self.num_running = gauge("cenote_num_requests_running", "Requests running in the engine")
        self.kv_cache_usage = gauge(
            "cenote_kv_cache_usage_perc", "Fraction of KV cache blocks in use"
        )
        self.scheduled_tokens = histogram(
            "cenote_scheduled_tokens_per_step", "Tokens scheduled in one engine step",
            _TOKEN_BUCKETS,
        )  # fmt: skip
        self.prompt_tokens = counter("cenote_prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("cenote_generation_tokens", "Tokens generated")
        self.spec_draft_tokens = counter(
            "cenote_spec_decode_num_draft_tokens", "Speculative decoding: tokens drafted"
        )
        self.spec_accepted_tokens = counter(
            "cenote_spec_decode_num_accepted_tokens",
            "Speculative decoding: drafted tokens the model accepted",
        )
        self.queue_time = histogram(
            "cenote_request_queue_time_seconds", "Time from arrival to first scheduling",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.ttft = histogram(
            "cenote_time_to_first_token_seconds", "Time to the first output (token or pooled)",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = histogram(
            "cenote_e2e_request_latency_seconds", "Time from arrival to the last output",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.cache_hits = counter(
            "cenote_embedding_cache_hits", "Pooling inputs answered without computing them"
        )
        self.cache_misses = counter(
            "cenote_embedding_cache_misses", "Cacheable pooling inputs computed by the engine"
        )
        self.cache_evictions = counter(
            "cenote_embedding_cache_evictions", "Embedding cache entries evicted (LRU)"
        )
        self.cache_entries = gauge("cenote_embedding_cache_entries", "Embedding cache entries")
        self.cache_bytes = gauge(
            "cenote_embedding_cache_bytes", "Embedding cache size: results, keys, overhead"
        )

        # per task, counted once the response is sent (app.py FrontDoor: from the front door
        # taking the request to the response's last byte); the engine answered each of them
        task_labels = ["model_name", "task"]
        self.task_requests = Counter(
            "cenote_task_requests", "Requests the engine answered, by model and task",
            task_labels, registry=r,
        )  # fmt: skip
        self.task_prompt_tokens = Counter(
            "cenote_task_prompt_tokens", "Prompt tokens of the requests answered, by task",
            task_labels, registry=r,
        )  # fmt: skip
        self.task_latency = Histogram(
            "cenote_task_request_latency_seconds",
            "Time from the front door taking a request to its response sent, by task",
            task_labels, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def record_task(self, model: str, task: str, num_prompt_tokens: int, seconds: float) -> None:
        """One request the engine answered: ``task`` as the route ran it (``score`` for the
        scoring routes, whatever the model computes under them)."""
        self.task_requests.labels(model, task).inc()
        self.task_prompt_tokens.labels(model, task).inc(num_prompt_tokens)
        self.task_latency.labels(model, task).observe(max(seconds, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ServerMetrics:
    """One model's series in the server's registry (``families``; its own when not given)."""

    def __init__(self, model_name: str, families: MetricFamilies | None = None) -> None:
        self.families = f = families if families is not None else MetricFamilies()
        self._evictions_seen = 0  # the cache's eviction count at the last record_cache
        self.num_waiting = f.num_waiting.labels(model_name)
        self.num_running = f.num_running.labels(model_name)
        self.kv_cache_usage = f.kv_cache_usage.labels(model_name)
        self.scheduled_tokens = f.scheduled_tokens.labels(model_name)
        self.prompt_tokens = f.prompt_tokens.labels(model_name)
        self.generation_tokens = f.generation_tokens.labels(model_name)
        self.spec_draft_tokens = f.spec_draft_tokens.labels(model_name)
        self.spec_accepted_tokens = f.spec_accepted_tokens.labels(model_name)
        self.queue_time = f.queue_time.labels(model_name)
        self.ttft = f.ttft.labels(model_name)
        self.e2e = f.e2e.labels(model_name)
        self.cache_hits = f.cache_hits.labels(model_name)
        self.cache_misses = f.cache_misses.labels(model_name)
        self.cache_evictions = f.cache_evictions.labels(model_name)
        self.cache_entries = f.cache_entries.labels(model_name)
        self.cache_bytes = f.cache_bytes.labels(model_name)

    def record_step(self, stats: SchedulerStats | None, queue_times: list[float]) -> None:
        """Called by the engine client for every message from the core."""
        if stats is not None:
            self.num_waiting.set(stats.num_waiting)
            self.num_running.set(stats.num_running)
            self.kv_cache_usage.set(stats.kv_cache_usage)
            if stats.num_scheduled_tokens:
                self.scheduled_tokens.observe(stats.num_scheduled_tokens)
            if stats.num_draft_tokens:
                self.spec_draft_tokens.inc(stats.num_draft_tokens)
                self.spec_accepted_tokens.inc(stats.num_accepted_tokens)
        for seconds in queue_times:
            self.queue_time.observe(max(seconds, 0.0))

    def record_cache(self, num_hits: int, num_misses: int, cache: EmbeddingCache) -> None:
        self.cache_hits.inc(num_hits)
        self.cache_misses.inc(num_misses)
        self.cache_evictions.inc(cache.num_evictions - self._evictions_seen)
        self._evictions_seen = cache.num_evictions
        self.cache_entries.set(len(cache))
        self.cache_bytes.set(cache.num_bytes)
