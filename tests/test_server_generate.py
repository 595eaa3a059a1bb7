"""Completions and chat completions through a real server on a tiny random Llama."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gen_factories import make_decoder
from tests.server_fixture import ServerProcess


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    make_decoder(folder, "llama")
    server = ServerProcess(str(folder), "--dtype", "float32", "--num-threads", "1")
    try:
        yield server
    finally:
        server.stop()


def test_completion_greedy_stream_matches_non_stream(llama_server):
    body = {"prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=llama_server.url, timeout=60) as http:
        full = http.post("/v1/completions", json={**body, "logprobs": 2}).json()
        choice = full["choices"][0]
        assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
        assert len(choice["logprobs"]["tokens"]) == 6 and choice["finish_reason"] == "length"
        stream = http.post(
            "/v1/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["text"] for chunk in chunks for c in chunk["choices"])
    assert text == choice["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_completion_n_and_seed(llama_server):
    body = {"prompt": ["w5", "w9 w10"], "max_tokens": 4, "n": 2, "seed": 7}
    with httpx.Client(base_url=llama_server.url, timeout=60) as http:
        first = http.post("/v1/completions", json=body).json()
        second = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in second["choices"]]


def test_chat_without_template_is_400(llama_server):
    body = {"messages": [{"role": "user", "content": "w5"}]}
    response = httpx.post(f"{llama_server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]
