"""The HTTP server, through real clients against a real ``cenote serve`` process."""

from __future__ import annotations

import base64
import os
import re
import signal
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from tests.server_fixture import ServerProcess

API_KEY = "test-key"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
SENTENCES = ["The cat sits on the mat.", "A quick brown fox.", "Embeddings are vectors."]
LONG_TEXT = "word " * 300  # > 256 tokens, the model's limit


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(
        "--dtype", "float32", "--num-threads", "1", "--max-inputs", "512",
        "--max-body-bytes", "2000000", api_key=API_KEY,
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def offline():
    from cenote import LLM

    return LLM(dtype="float32", num_threads=1)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in metrics"
    return float(match.group(1))


def test_health_version_models(server, http):
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    assert http.get("/version").json()["version"]
    models = http.get("/v1/models").json()["data"]
    assert models[0]["id"] == MODEL and models[0]["supported_tasks"] == ["embed", "token_embed"]


def test_api_key_enforced(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


def test_openai_embeddings_float_and_base64_match_offline(server, offline):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    floats = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    raw = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="base64")
    expected = np.stack([o.outputs.data.numpy() for o in offline.embed(SENTENCES)])
    got_float = np.array([d.embedding for d in floats.data], dtype=np.float32)
    got_b64 = np.stack(
        [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]
    )
    np.testing.assert_allclose(got_float, got_b64, atol=1e-7)
    np.testing.assert_allclose(got_float, expected, atol=1e-5)
    num_tokens = sum(len(o.prompt_token_ids) for o in offline.embed(SENTENCES))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == num_tokens


def test_embeddings_token_id_inputs(http, offline):
    ids = offline.embed(SENTENCES[:2])
    token_lists = [o.prompt_token_ids for o in ids]
    one = http.post("/v1/embeddings", json={"input": token_lists[0]}).json()
    many = http.post("/v1/embeddings", json={"input": token_lists}).json()
    np.testing.assert_allclose(one["data"][0]["embedding"], ids[0].outputs.data, atol=1e-5)
    assert [d["index"] for d in many["data"]] == [0, 1]
    np.testing.assert_allclose(many["data"][1]["embedding"], ids[1].outputs.data, atol=1e-5)


def test_pooling_route(http):
    body = http.post("/pooling", json={"input": SENTENCES[:2]}).json()
    assert body["object"] == "list" and body["data"][0]["object"] == "pooling"
    assert len(body["data"][0]["data"]) == 384
    tokens = http.post("/pooling", json={"input": "hello world", "task": "token_embed"}).json()
    assert len(tokens["data"][0]["data"]) == tokens["usage"]["prompt_tokens"]


def test_tokenize_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 4 and tokens["max_model_len"] == 256
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "hello world"


@pytest.mark.parametrize(
    ("route", "body", "status", "message"),
    [
        ("/v1/embeddings", {"input": "x", "model": "nope"}, 404, "does not exist"),
        ("/v1/embeddings", {"input": [SENTENCES[0], LONG_TEXT]}, 400, "prompt 1 has 302 tokens"),
        ("/v1/embeddings", {"input": ["a"] * 513}, 400, "513 inputs, the limit per request is 512"),
        ("/v1/embeddings", {"input": []}, 400, "input is empty"),
        ("/v1/embeddings", {"input": ["a", ""]}, 400, "input 1 is an empty string"),
        ("/v1/embeddings", {"input": [1, 10**6]}, 400, "outside the vocabulary (size 30522)"),
        ("/v1/embeddings", {"input": "a", "dimensions": 8}, 400, "embedding size is 384"),
        ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 999}, 400, "between 1 and 256"),
        ("/v1/embeddings", {"messages": [{"role": "user", "content": "a"}]}, 400, "chat template"),
        ("/v1/embeddings", {"input": 5}, 400, "input"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, 400, "encoding_format"),
        ("/v1/completions", {"prompt": "a"}, 400, "it supports embed, token_embed"),
        ("/pooling", {"input": "a", "task": "classify"}, 400, "it supports embed, token_embed"),
        ("/v1/embeddings", {"input": "a" * 2_100_000}, 413, "limit is 2000000"),
    ],
)
def test_bad_inputs(http, route, body, status, message):
    response = http.post(route, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == status


def test_truncation_makes_long_input_fit(http):
    body = {"input": LONG_TEXT, "truncate_prompt_tokens": -1}
    assert http.post("/v1/embeddings", json=body).json()["usage"]["prompt_tokens"] == 256


def test_metrics(http):
    http.post("/v1/embeddings", json={"input": "count me"})
    text = http.get("/metrics").text
    assert 'cenote_http_requests_total{endpoint="/v1/embeddings",status="200"}' in text
    for name in (
        "cenote_num_requests_running",
        "cenote_num_requests_waiting",
        "cenote_prompt_tokens_total",
        "cenote_scheduled_tokens_per_step_count",
        "cenote_request_queue_time_seconds_count",
        "cenote_time_to_first_token_seconds_count",
        "cenote_e2e_request_latency_seconds_count",
    ):
        assert _metric(text, name) >= 0
    assert _metric(text, "cenote_prompt_tokens_total") > 0


def test_disconnecting_client_is_aborted(server, http):
    body = {"input": [LONG_TEXT] * 256, "truncate_prompt_tokens": -1}  # 65,536 tokens: seconds
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/embeddings", json=body, headers=server.headers, timeout=0.5)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        running = _metric(text, "cenote_num_requests_running")
        waiting = _metric(text, "cenote_num_requests_waiting")
        if running == waiting == 0:
            break
        time.sleep(0.1)
    assert running == waiting == 0
    assert http.post("/v1/embeddings", json={"input": "still alive"}).status_code == 200


@pytest.mark.stops_module_server
def test_sigterm_drains_in_flight_requests(server):
    """Runs last in the module (conftest): it stops the shared server."""
    body = {"input": [LONG_TEXT] * 64, "truncate_prompt_tokens": -1}
    result = {}

    def send() -> None:
        result["response"] = httpx.post(
            f"{server.url}/v1/embeddings", json=body, headers=server.headers, timeout=60
        )

    before = server.num_steps()
    thread = threading.Thread(target=send)
    thread.start()
    server.wait_for_steps(before)  # in flight
    server.process.send_signal(signal.SIGTERM)
    thread.join(60)
    assert result["response"].status_code == 200
    assert len(result["response"].json()["data"]) == 64
    assert server.process.wait(30) == 0


def test_engine_death_fails_fast_and_exits_nonzero():
    server = ServerProcess("--dtype", "float32", "--num-threads", "1")
    try:
        body = {"input": [LONG_TEXT] * 256, "truncate_prompt_tokens": -1}
        result = {}

        def send() -> None:
            result["response"] = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)

        before = server.num_steps()
        thread = threading.Thread(target=send)
        thread.start()
        server.wait_for_steps(before)  # in flight
        killed_at = time.monotonic()
        os.kill(server.engine_pid(), signal.SIGKILL)
        thread.join(10)
        assert time.monotonic() - killed_at < 5
        response = result["response"]
        assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
        assert response.headers["Retry-After"] == "1"
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert server.process.wait(20) != 0
    finally:
        server.stop()


def test_overload_answers_429_with_retry_after():
    """Inputs beyond max_num_seqs running + max_waiting_requests waiting are refused, not queued."""
    small = ServerProcess(
        "--dtype", "float32", "--num-threads", "1", "--max-num-seqs", "1",
        "--max-waiting-requests", "2",
    )  # fmt: skip
    try:
        with httpx.Client(base_url=small.url, timeout=60) as client:
            refused = client.post("/v1/embeddings", json={"input": SENTENCES + ["one more"]})
            accepted = client.post("/v1/embeddings", json={"input": SENTENCES})
    finally:
        small.stop()
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    error = refused.json()["error"]
    assert error["code"] == 429 and "4 more would exceed 1 running + 2 waiting" in error["message"]
    assert accepted.status_code == 200 and len(accepted.json()["data"]) == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/model"], "is not a model folder (config.json is missing) nor a .gguf file"),
        (["--pooler-config", '{"pooling_type": "MAX"}'], "pooling_type must be one of"),
        (["--port", "70000"], "--port must be between 1 and 65535, got 70000"),
        (["--port", "IN_USE"], "Address already in use"),
    ],
)
def test_bad_command_line_exits_2_with_the_reason(args, message):
    import socket
    import subprocess
    import sys

    from tests.server_fixture import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = [str(taken.getsockname()[1]) if a == "IN_USE" else a for a in args]
        port = [] if "--port" in args else ["--port", str(free_port())]
        done = subprocess.run(
            [sys.executable, "-m", "cenote", "serve", *args, *port],
            capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_version():
    import subprocess
    import sys

    import cenote

    done = subprocess.run(
        [sys.executable, "-m", "cenote", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == f"cenote {cenote.__version__}"


def test_dimensions_of_the_full_size_are_accepted_on_any_model(http):
    """Clients (vector-store integrations) send ``dimensions`` always: the model's own size
    cuts nothing and is no matryoshka request; a real cut keeps its 400 (test_bad_inputs)."""
    plain = http.post("/v1/embeddings", json={"input": SENTENCES[:2]}).json()
    sized = http.post("/v1/embeddings", json={"input": SENTENCES[:2], "dimensions": 384})
    assert sized.status_code == 200, sized.text
    assert [d["embedding"] for d in sized.json()["data"]] == [d["embedding"] for d in plain["data"]]


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_quantized_embeddings_are_sentence_transformers_quantize_embeddings(http, precision):
    """encoding_format int8 / uint8 / binary / ubinary: exactly sentence-transformers'
    ``quantize_embeddings`` of the float embeddings (int8 / uint8 with the request's own ranges,
    as its ``encode(precision=)``, and with given ``quantization_ranges``)."""
    from sentence_transformers.util.quantization import quantize_embeddings

    floats = http.post("/v1/embeddings", json={"input": SENTENCES}).json()
    vectors = np.array([d["embedding"] for d in floats["data"]], dtype=np.float32)
    got = http.post("/v1/embeddings", json={"input": SENTENCES, "encoding_format": precision})
    assert got.status_code == 200, got.text
    expected = quantize_embeddings(vectors, precision=precision)
    assert [d["embedding"] for d in got.json()["data"]] == expected.tolist()
    assert got.json()["usage"] == floats["usage"]
    if precision in ("int8", "uint8"):
        ranges = np.stack([np.full(384, -0.2), np.full(384, 0.2)]).astype(np.float32)
        body = {"input": SENTENCES[:1], "encoding_format": precision,
                "quantization_ranges": ranges.tolist()}  # fmt: skip
        one = http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
        assert one == quantize_embeddings(vectors[:1], precision, ranges=ranges).tolist()[0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": "a", "encoding_format": "int8"}, "at least 2 inputs to take the ranges"),
        ({"input": ["a", "b"], "encoding_format": "uint8", "quantization_ranges": [[0.0] * 3]},
         "must be [[min] * 384, [max] * 384] (the embedding size); got 1 rows of [3]"),
        ({"input": "a", "encoding_format": "binary", "quantization_ranges": [[0.0], [1.0]]},
         "applies to encoding_format 'int8' or 'uint8', not 'binary'"),
        ({"input": "a", "quantization_ranges": [[0.0], [1.0]]}, "not 'float'"),
        ({"input": "a", "encoding_format": "binary", "embed_dtype": "float16"}, "embed_dtype"),
        ({"input": "a", "encoding_format": "ubinary", "sparse": True}, "not sparse ones"),
    ],
)  # fmt: skip
def test_quantized_embeddings_bad_input(http, body, message):
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    pooled = http.post("/pooling", json={"input": "a", "encoding_format": "int8"})
    assert pooled.status_code == 400 and "/v1/embeddings" in pooled.json()["error"]["message"]


def test_prompts_per_request(http):
    """``prompt`` (literal) and ``prompt_name`` (the model's prompts; MiniLM has none) on
    /v1/embeddings and /pooling: the instruction goes before each text."""
    texts = ["query: " + s for s in SENTENCES]
    plain = http.post("/v1/embeddings", json={"input": texts}).json()["data"]
    prompted = http.post("/v1/embeddings", json={"input": SENTENCES, "prompt": "query: "})
    assert prompted.status_code == 200, prompted.text
    assert [d["embedding"] for d in prompted.json()["data"]] == [d["embedding"] for d in plain]
    assert prompted.json()["usage"]["prompt_tokens"] > len(SENTENCES) * 3
    pooled = http.post("/pooling", json={"input": SENTENCES[:1], "prompt": "query: "}).json()
    assert pooled["data"][0]["data"] == plain[0]["embedding"]
    unknown = http.post("/v1/embeddings", json={"input": "a", "prompt_name": "query"})
    assert unknown.status_code == 400
    assert "prompt_name 'query' is not one of the model's prompts (none" in unknown.text
    both = http.post("/v1/embeddings", json={"input": "a", "prompt_name": "q", "prompt": "q: "})
    assert both.status_code == 400 and "not both" in both.text


def test_long_input_chunked_over_http(http, offline):
    """``long_input: "chunk"``: a text past the model's 256 tokens is embedded in windows joined
    into one embedding (as the offline engine does; tests/engine/test_chunking.py checks the math
    against sentence-transformers), usage counts every window's tokens; without it, a 400."""
    from cenote import PoolingParams

    body = {"input": [LONG_TEXT, "short"], "long_input": "chunk", "chunk_overlap": 16}
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    params = PoolingParams(long_input="chunk", chunk_overlap=16)
    expected = offline.embed([LONG_TEXT, "short"], params, use_tqdm=False)
    for item, out in zip(response.json()["data"], expected, strict=True):
        assert np.allclose(item["embedding"], out.outputs.embedding, atol=1e-5)
    assert response.json()["usage"]["prompt_tokens"] == sum(
        len(o.prompt_token_ids) for o in expected
    )
    assert response.json()["usage"]["prompt_tokens"] > 300
    refused = http.post("/v1/embeddings", json={"input": LONG_TEXT})
    assert refused.status_code == 400 and "max_model_len" in refused.text
    token_level = http.post(
        "/pooling", json={"input": LONG_TEXT, "task": "token_embed", "long_input": "chunk"}
    )
    assert token_level.status_code == 400 and "long_input 'chunk' joins" in token_level.text


def test_short_inputs_share_steps(server, http):
    """256 short texts in one request run in a few engine steps, not one step each: a pooling
    call's share holds a measurable step's worth of tokens before any step time is known (a
    share of one request never measured a step of one short text: the server ran 128 texts/s)."""
    texts = [f"text number {i}" for i in range(256)]
    before = server.num_steps()
    response = http.post("/v1/embeddings", json={"input": texts})
    assert response.status_code == 200, response.text
    steps = server.num_steps() - before
    assert steps <= 32, f"{steps} engine steps for 256 short texts"
