"""Completions and chat completions through a real server on a tiny random Llama."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tests.factories.decoders import make_decoder
from tests.server_fixture import ServerProcess


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    make_decoder(folder, "llama")
    server = ServerProcess(
        str(folder), "--dtype", "float32", "--num-threads", "1", "--max-response-values", "2000",
        "--max-num-seqs", "4",  # the shares test: a request of 8 completions fills every slot
    )  # fmt: skip
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


def test_prompt_logprobs_beyond_the_response_bound_are_400(llama_server):
    """Each prompt token returns prompt_logprobs + 1 numbers: 2 prompts x 50 tokens x 21 are
    past --max-response-values 2000, and are refused before running; x 6 are served."""
    body = {"prompt": ["w5 " * 50, "w6 " * 50], "max_tokens": 1, "prompt_logprobs": 20}
    with httpx.Client(base_url=llama_server.url, timeout=60) as http:
        refused = http.post("/v1/completions", json=body)
        served = http.post("/v1/completions", json={**body, "prompt_logprobs": 5})
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "2100 numbers" in message and "--max-response-values" in message
    assert "100 prompt tokens x (prompt_logprobs 20 + 1)" in message
    assert served.status_code == 200, served.text
    assert [len(c["prompt_logprobs"]) for c in served.json()["choices"]] == [50, 50]


def test_chat_without_template_is_400(llama_server):
    body = {"messages": [{"role": "user", "content": "w5"}]}
    response = httpx.post(f"{llama_server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]


# ---- the official openai client, results equal to the offline engine -------------------------

CHAT_TEMPLATE = (  # bos_token / eos_token come from the model's config, as templates expect
    "{% for m in messages %}{{ bos_token }} {{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """A tiny Llama whose folder carries a chat template, and the offline LLM on the same folder."""
    folder = tmp_path_factory.mktemp("tiny_llama_chat")
    make_decoder(folder, "llama", seed=3)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    server = ServerProcess(str(folder), "--dtype", "float32", "--num-threads", "1")
    try:
        yield server, folder
    finally:
        server.stop()


@pytest.fixture(scope="module")
def offline_llm(chat_server):
    from cenote import LLM

    return LLM(str(chat_server[1]), dtype="float32", num_threads=1)


def _openai(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_openai_completions_equal_offline(chat_server, offline_llm):
    from cenote import SamplingParams

    server, _ = chat_server
    client = _openai(server)
    prompts = ["w5 w6 w7", "w40 w41"]
    response = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompts, max_tokens=8, temperature=0
    )
    expected = offline_llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert texts == [out.outputs[0].text for out in expected]
    assert response.usage.prompt_tokens == 5


def test_openai_chat_streamed_and_not_equal_offline(chat_server, offline_llm):
    from cenote import SamplingParams

    server, _ = chat_server
    client = _openai(server)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "w10 w11 w12"}]
    full = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0
    )
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    expected = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=6))
    assert expected[0].prompt == "<s> w10 w11 w12 </s> <s>"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == streamed == expected[0].outputs[0].text


def test_client_disconnecting_mid_stream_is_aborted(chat_server):
    """Read two chunks of a long stream, hang up: the request leaves the engine at once."""
    server, _ = chat_server
    body = {"prompt": "w5", "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = _metric(http.get("/metrics").text, "cenote_generation_tokens_total")
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(4), strict=False) if line]
        assert len(received) >= 2
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = http.get("/metrics").text
            if _metric(text, "cenote_num_requests_running") == 0:
                break
            time.sleep(0.05)
        assert _metric(text, "cenote_num_requests_running") == 0
        assert _metric(text, "cenote_num_requests_waiting") == 0
        generated = _metric(text, "cenote_generation_tokens_total") - before
        assert generated < 250  # aborted, not run to the end
        assert (
            http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2}).status_code == 200
        )


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in metrics"
    return float(match.group(1))


def test_embeddings_of_chat_messages_equal_offline(chat_server, offline_llm):
    """``messages`` input to /v1/embeddings: rendered with the chat template (no generation
    prompt), then embedded like any text."""
    server, _ = chat_server
    messages = [{"role": "user", "content": "w20 w21"}, {"role": "assistant", "content": "w22"}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post("/v1/embeddings", json={"messages": messages})
    assert response.status_code == 200, response.text
    served = response.json()["data"][0]["embedding"]
    expected = offline_llm.embed(["<s> w20 w21 </s> <s> w22 </s> "], use_tqdm=False)[0]
    assert max(abs(a - b) for a, b in zip(served, expected.outputs.embedding, strict=True)) < 1e-5


def test_chat_template_kwargs_may_not_set_request_fields(chat_server):
    """The template's own arguments come from the request's fields, not from its kwargs (a
    duplicate was a TypeError and a 500)."""
    server, _ = chat_server
    body = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2,
            "chat_template_kwargs": {"continue_final_message": True}}  # fmt: skip
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "chat_template_kwargs may not set continue_final_message" in message


def test_streamed_text_with_a_stop_string_equals_the_full_text(llama_server):
    """Streaming holds back only what could still become a stop string, and never shows it."""
    body = {"prompt": "w5 w6 w7", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=llama_server.url, timeout=60) as http:
        words = http.post("/v1/completions", json=body).json()["choices"][0]["text"].split()
        stop = words[len(words) // 2]  # a word from the middle of the greedy output
        full = http.post("/v1/completions", json={**body, "stop": [stop]}).json()
        stream = http.post("/v1/completions", json={**body, "stop": [stop], "stream": True})
    choice = full["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"].split()
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == choice["text"]


# ---- fairness: a generation request's completions keep half of the sequences --------------

TIMEOUT = 120


def test_a_small_request_runs_beside_a_big_generation_request(llama_server):
    """The big request's 8 completions would fill every slot for 240 steps, the small request
    (sent after it) waiting behind 4 of them; its share is 2 of the 4 slots, so the small
    request runs at once, while the big one has streamed a small part of its tokens."""
    big = {"prompt": "w5 w6", "n": 8, "max_tokens": 240, "ignore_eos": True, "stream": True}
    chunks: list[str] = []
    started = threading.Event()

    def run_big() -> None:
        with httpx.stream("POST", f"{llama_server.url}/v1/completions", json=big,
                          timeout=TIMEOUT) as response:  # fmt: skip
            if response.status_code != 200:
                chunks.append(response.read().decode())
                started.set()
                return
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(line)
                    started.set()

    thread = threading.Thread(target=run_big)
    thread.start()
    assert started.wait(TIMEOUT)
    small = httpx.post(f"{llama_server.url}/v1/completions", json={"prompt": "w7", "max_tokens": 2},
                       timeout=TIMEOUT)  # fmt: skip
    chunks_then = len(chunks)
    thread.join()
    assert small.status_code == 200, small.text
    assert len(chunks) > 400, chunks[:1]  # about one chunk per token
    assert chunks_then < len(chunks) // 4, (chunks_then, len(chunks))


def test_streamed_events_match_the_declared_schema(llama_server):
    """A streamed response documents the schema of one SSE event, as schemathesis and OpenAPI
    3.2's ``itemSchema`` read it (a plain string made every streamed 200 a violation)."""
    import jsonschema

    spec = httpx.get(f"{llama_server.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):  # both declare the same event
        content = spec["paths"][path]["post"]["responses"]["200"]["content"]
        assert content["text/event-stream"]["schema"]["required"] == ["data"]
    event_schema = content["text/event-stream"]["schema"]
    body = {"prompt": "w5 w6 w7", "max_tokens": 4, "stream": True}
    url = f"{llama_server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [{"data": line.removeprefix("data: ")} for line in lines]
    assert events[-1]["data"] == "[DONE]" and len(events) >= 2
    for event in events:
        jsonschema.validate(event, event_schema)
