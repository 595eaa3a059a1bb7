"""Every route fuzzed over the server's own OpenAPI schema (schemathesis), on both shared servers:
no 5xx, every status, content type and body as documented, and afterwards the server is healthy
and answers a fixed set of requests exactly as before.

Bounded and seeded for CI (the same requests every run); ``tests/compat/fuzz_server.py`` runs the
same fuzzing for thousands of requests.
"""

from __future__ import annotations

import httpx
import pytest

from tests.compat.schema_fuzz import EMBEDDING_PROBES, GENERATION_PROBES, answers, fuzz

EXAMPLES_PER_OPERATION = 15  # per generation mode (3 modes): ~800 requests, both servers
SEED = 20240817

# routes whose fuzzed cases must reach the engine (some 200s), or the fuzzing tested nothing
REACHED = {
    "default_server": ["POST /v1/embeddings", "POST /pooling", "POST /score", "POST /v1/rerank",
                       "POST /v2/rerank", "POST /tokenize", "POST /embed", "POST /embed_all",
                       "POST /similarity", "POST /decode", "POST /rerank"],
    "smollm2_server": ["POST /v1/completions", "POST /v1/chat/completions",
                       "POST /v1/embeddings", "POST /tokenize"],
}  # fmt: skip
PROBES = {"default_server": EMBEDDING_PROBES, "smollm2_server": GENERATION_PROBES}


@pytest.mark.parametrize("server_name", ["default_server", "smollm2_server"])
def test_fuzzed_requests_are_answered_as_documented(request, server_name):
    server = request.getfixturevalue(server_name)
    before = answers(server.url, PROBES[server_name])
    spec = httpx.get(f"{server.url}/openapi.json").json()

    report = fuzz(server.url, EXAMPLES_PER_OPERATION, seed=SEED)

    print(report.table(server_name))
    problems = "\n\n".join(
        f"{v.route} -> {v.status}: {v.message}\n{v.curl}" for v in report.violations[:10]
    )
    assert report.num_server_errors == 0 and not report.violations, problems
    operations = {f"{m.upper()} {p}" for p, ops in spec["paths"].items() for m in ops}
    assert set(report.statuses) == operations
    for route in REACHED[server_name]:
        assert report.statuses[route][200] > 0, f"no fuzzed {route} reached the engine"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert answers(server.url, PROBES[server_name]) == before
