"""Property-based fuzzing of a running ``cenote serve`` over its own OpenAPI schema.

schemathesis generates request bodies, paths and queries from ``/openapi.json`` (positive cases:
bodies the schema allows; negative: bodies it forbids) and checks each answer: no 5xx, a status
the operation documents, the documented content type, a body matching the documented schema.
``fuzz`` sends the cases and collects every violation (no shrinking, so a run's request count is
what was asked); ``answers`` records a fixed set of requests so a run can show the server answers
them the same before and after. Used by ``tests/compat/test_server_fuzz.py`` (small, seeded: CI) and
``tests/compat/fuzz_server.py`` (thousands of requests).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# (mode, steered): raw positive cases, positive cases steered past the checks the schema cannot
# state (cross-field, the served model's limits) so that they reach the engine, negative cases
MODES = ((POSITIVE, False), (POSITIVE, True), (NEGATIVE, False))

# Generation lengths are capped so a run's time is bounded (a fuzzed temperature of 1e30 with
# max_tokens 8000 samples 8000 uniform tokens). Only valid-but-expensive values are lowered:
# negative, zero and absurdly large values are sent as drawn and must be refused cheaply.
_COST_CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 8, "n": 4}
_CHEAP_ABOVE = 1 << 20  # values above this are refused at the edge without running
_CHAT_PATH = "/v1/chat/completions"  # without a max_tokens, chat runs to the end of the context
# (so does /invocations with chat messages)
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Violation:
    route: str  # "POST /v1/embeddings"
    status: int | None  # None: no answer (connection error, timeout)
    kinds: list[str]  # schemathesis' failure titles, e.g. "Server error"
    message: str
    curl: str  # reproduces the request


@dataclass
class FuzzReport:
    statuses: dict[str, Counter] = field(default_factory=dict)  # route -> status -> count
    violations: list[Violation] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(sum(c.values()) for c in self.statuses.values())

    @property
    def num_server_errors(self) -> int:
        return sum(n for c in self.statuses.values() for s, n in c.items() if s >= 500)

    def merge(self, other: FuzzReport) -> None:
        for route, counts in other.statuses.items():
            self.statuses.setdefault(route, Counter()).update(counts)
        self.violations.extend(other.violations)
        self.seconds += other.seconds

    def table(self, title: str = "") -> str:
        """Requests per route, their statuses, 5xx and schema violations."""
        statuses = sorted({s for c in self.statuses.values() for s in c})
        header = ["route", "requests", *map(str, statuses), "5xx", "violations"]
        rows = []
        for route in sorted(self.statuses):
            counts = self.statuses[route]
            bad = sum(1 for v in self.violations if v.route == route)
            server = sum(n for s, n in counts.items() if s >= 500)
            rows.append([route, sum(counts.values()), *(counts[s] for s in statuses), server, bad])
        total = [self.num_requests, *(sum(c[s] for c in self.statuses.values()) for s in statuses)]
        rows.append(["total", *total, self.num_server_errors, len(self.violations)])
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        lines = [title] if title else []
        for row in [header, *rows]:
            cells = [str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in
                     enumerate(zip(row, widths, strict=True))]  # fmt: skip
            lines.append("  ".join(cells))
        lines.append(f"{self.num_requests} requests in {self.seconds:.1f} s")
        return "\n".join(lines)


def load_schema(url: str) -> Any:
    return schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=30)


def cap_cost(path: str, body: Any) -> Any:
    """The body with expensive generation lengths lowered (see ``_COST_CAPS``)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for name, cap in _COST_CAPS.items():
        value = body.get(name)
        if type(value) is int and cap < value <= _CHEAP_ABOVE:
            body[name] = cap
    chat = path == _CHAT_PATH or (path == "/invocations" and "messages" in body)
    if chat and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = _COST_CAPS["max_tokens"]
    return body


# Fields of which a request takes exactly one (or one pair): the schema cannot say so.
_ONE_OF = {
    "/v1/embeddings": (("input",), ("messages",)),
    "/pooling": (("input",), ("messages",)),
    "/classify": (("input",), ("messages",)),
    "/tokenize": (("prompt",), ("messages",)),
    "/score": (("queries", "documents"), ("data_1", "data_2"), ("text_1", "text_2")),
    "/v1/score": (("queries", "documents"), ("data_1", "data_2"), ("text_1", "text_2")),
}
_FILL = {"input": "steered input", "prompt": "steered prompt", "queries": "a query",
         "documents": ["a document"], "data_1": "a", "data_2": "b", "text_1": "a", "text_2": "b"}  # fmt: skip
# OpenAI / TEI fields cenote refuses when they ask for anything (the raw cases cover that), and
# output constraints: a drawn regex or schema is a 400 or a constraint no random prompt meets
_REFUSED = frozenset({"tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                      "response_format", "suffix", "best_of", "prompt_name",
                      "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "guided_whitespace_pattern",
                      "guided_decoding_backend",
                      # BGE-M3's combined score: a 400 on every other model
                      "weights_for_different_modes"})  # fmt: skip


def steer(path: str, body: Any) -> Any:
    """A positive body made past the checks that span fields: no ``model`` (a drawn name is
    an unknown model) and no refused field, exactly one of the exclusive inputs, chat messages
    with a real role, at least one rerank document; generation bodies also past the served
    model's limits (``_steer_generation``). Every other drawn value is kept."""
    if not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k != "model" and k not in _REFUSED}
    groups = _ONE_OF.get(path, ())
    given = [g for g in groups if all(body.get(name) is not None for name in g)]
    keep = given[0] if given else (groups[0] if groups else ())
    for group in groups:
        for name in group:
            if group != keep:
                body.pop(name, None)
            elif body.get(name) is None:
                body[name] = _FILL[name]
    if isinstance(body.get("messages"), list):
        body["messages"] = [_steer_message(m) for m in body["messages"]] or [_steer_message({})]
    if body.get("documents") == []:
        body["documents"] = ["a document"]
    if path in _SCORE_PATHS:
        for name in _SCORE_FIELDS:
            if name in body:
                body[name] = _steer_score_input(body[name])
    if path in _GENERATION_PATHS:
        _steer_generation(path, body)
    return body


_SCORE_PATHS = ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
_SCORE_FIELDS = ("query", "documents", "queries", "data_1", "data_2", "text_1", "text_2")


def _steer_score_input(value: Any) -> Any:
    """vLLM's multimodal score inputs kept in shape, their parts made valid: a top-level
    ``{"content": [...]}`` gets text parts, a list element ``{"content": [...]}`` exactly one
    (drawn part types and counts are the raw cases' to test)."""
    if isinstance(value, dict) and "content" in value:
        parts = value["content"] if isinstance(value["content"], list) else []
        return {
            "content": [{"type": "text", "text": "a part"} for _ in parts[:3]]
            or [{"type": "text", "text": "a part"}]
        }
    if isinstance(value, list):
        return [
            {"content": [{"type": "text", "text": "a part"}]}
            if isinstance(v, dict) and "content" in v
            else v
            for v in value
        ]
    return value


_GENERATION_PATHS = ("/v1/completions", _CHAT_PATH)
_NUM_COMMON_IDS = 1000  # token ids below this are in the vocabulary of every fuzzed model
# limits of the served model and its options (max_logprobs, max_model_len): values drawn above
# them are lowered
_MODEL_LIMITS = {"logprobs": 5, "top_logprobs": 5, "prompt_logprobs": 5, "max_tokens": 8,
                 "max_completion_tokens": 8, "min_tokens": 8, "truncate_prompt_tokens": 64}  # fmt: skip


def _steer_generation(path: str, body: dict[str, Any]) -> None:
    """In place: prompts that are not empty, token ids (prompt, stop, logit bias) the model
    has, lengths and logprob counts within its limits, and the fields that go together
    (``min_tokens`` <= ``max_tokens``, ``stream_options`` with ``stream``, ``top_logprobs``
    with ``logprobs``)."""
    for name, limit in _MODEL_LIMITS.items():
        if type(body.get(name)) is int and body[name] > limit:
            body[name] = limit
    if body.get("truncate_prompt_tokens") == 0:
        body["truncate_prompt_tokens"] = -1  # 0 is no length
    if "prompt" in body:
        body["prompt"] = _steer_prompt(body["prompt"])
    if isinstance(body.get("stop_token_ids"), list):
        body["stop_token_ids"] = [t % _NUM_COMMON_IDS for t in body["stop_token_ids"]]
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {str(i): v for i, v in enumerate(body["logit_bias"].values())}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if type(body.get("min_tokens")) is int and type(max_tokens) is int:
        body["min_tokens"] = min(body["min_tokens"], max_tokens)
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    if path == _CHAT_PATH and body.get("top_logprobs"):
        body["logprobs"] = True


def _steer_prompt(prompt: Any) -> Any:
    """A completion prompt with no empty text or token list, its ids in every vocabulary."""
    if isinstance(prompt, str):
        return prompt or _FILL["prompt"]
    if not isinstance(prompt, list) or not prompt:
        return _FILL["prompt"]
    if all(type(t) is int for t in prompt):
        return [t % _NUM_COMMON_IDS for t in prompt]
    return [_steer_prompt(p) if isinstance(p, str) or p else [1] for p in prompt]


def _steer_message(message: Any) -> dict[str, Any]:
    content = message.get("content") if isinstance(message, dict) else None
    texts = [
        v for v in (message.values() if isinstance(message, dict) else ()) if isinstance(v, str)
    ]
    if not isinstance(content, str):
        content = texts[0] if texts else "hello"
    return {"role": "user", "content": content}


def fuzz(url: str, examples_per_operation: int, seed: int = 0, schema: Any = None) -> FuzzReport:
    """Up to ``examples_per_operation`` cases of each mode (``MODES``) for every operation of
    the server at ``url``, seeded: the same seed sends the same requests, whatever the code of
    cenote and whichever modules the process has loaded (``_seed_alone``)."""
    schema = schema if schema is not None else load_schema(url)
    report = FuzzReport()
    started = time.monotonic()
    with requests.Session() as session, _seed_alone():
        served = session.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        target = _Target(url, session, served, report)
        for result in schema.get_all_operations():
            for mode, steered in MODES:
                _fuzz_operation(target, result.ok(), mode, steered, examples_per_operation, seed)
    report.seconds = time.monotonic() - started
    return report


@contextlib.contextmanager
def _seed_alone() -> Iterator[None]:
    """Hypothesis (6.131 on) also draws, now and then, literals it collects from the source of
    every loaded module outside the tests: cenote's. Then the requests a seed sends change with
    any edit of cenote and with the modules a run has imported, and a route may get no valid
    body at all in one run and many in the next. Without that pool the seed alone decides."""
    from hypothesis.internal.conjecture import providers

    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if not hasattr(providers, "_get_local_constants") or cache is None:
        yield  # a Hypothesis without the pool
        return
    cache.cache.clear()  # the pools of earlier draws
    try:
        with mock.patch.object(providers, "_get_local_constants", providers.Constants):
            yield
    finally:
        cache.cache.clear()


@dataclass
class _Target:
    url: str
    session: requests.Session
    served_model: str  # steered cases ask for this model by name in paths
    report: FuzzReport


def _fuzz_operation(target: _Target, operation, mode, steered, max_examples, seed) -> None:
    url, session, report = target.url, target.session, target.report
    route = f"{operation.method.upper()} {operation.path}"
    counts = report.statuses.setdefault(route, Counter())

    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # no shrinking: violations are collected, not raised
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def send(case: schemathesis.Case) -> None:
        if case.body is not None:
            body = steer(operation.path, case.body) if steered else case.body
            case.body = cap_cost(operation.path, body)
        if steered and "model" in (case.path_parameters or {}):
            case.path_parameters = {**case.path_parameters, "model": target.served_model}
        try:
            response = case.call(base_url=url, session=session, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as e:
            curl = case.as_curl_command()
            report.violations.append(Violation(route, None, ["No answer"], repr(e), curl))
            return
        counts[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (FailureGroup, Failure) as e:
            failures = e.exceptions if isinstance(e, FailureGroup) else (e,)
            report.violations.append(
                Violation(
                    route,
                    response.status_code,
                    [f.title for f in failures],
                    "\n".join(f"{f.title}: {f.message}" for f in failures),
                    case.as_curl_command(),
                )
            )

    if steered and not operation.body and "{" not in operation.path:
        return  # nothing to steer: the raw cases cover it
    # an operation without inputs has no negative cases
    with contextlib.suppress(hypothesis.errors.Unsatisfiable):
        send()


# ---- a fixed set of requests: answered the same before and after fuzzing ----------------------

_VOLATILE = frozenset({"id", "created"})  # differ per request by design


def answers(url: str, probes: list[tuple[str, str, dict | None]]) -> list[tuple[int, Any]]:
    """(status, body without ids and timestamps) of each ``(method, path, json)`` probe."""
    results = []
    with requests.Session() as session:
        for method, path, body in probes:
            response = session.request(method, f"{url}{path}", json=body, timeout=60)
            content: Any = response.text
            if response.headers.get("content-type", "").startswith("application/json"):
                content = _strip_volatile(response.json())
            results.append((response.status_code, content))
    return results


def _strip_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_volatile(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_strip_volatile(v) for v in value]
    return value


COMMON_PROBES: list[tuple[str, str, dict | None]] = [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "The quick brown fox", "return_token_strs": True}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3, 100, 1000]}),
    ("POST", "/v1/embeddings", {"input": ["a cat sat", "fuzzing the server"]}),
    ("POST", "/v1/embeddings", {"input": "hi", "encoding_format": "base64"}),
    ("POST", "/v1/embeddings", {"input": "hi", "bogus": 1}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}),
]
EMBEDDING_PROBES = COMMON_PROBES + [
    ("POST", "/score", {"queries": "a cat", "documents": ["a kitten", "a car"]}),
    ("POST", "/v1/rerank", {"query": "a cat", "documents": ["a kitten", "a car"], "top_n": 1}),
    ("POST", "/v2/rerank", {"query": "a cat", "documents": ["a kitten", "a car"]}),
    ("POST", "/pooling", {"input": "pooling probe"}),
]
GENERATION_PROBES = COMMON_PROBES + [
    ("POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8, "temperature": 0},
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True},
    ),
]
