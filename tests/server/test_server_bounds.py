"""No single client can stall the server: what one generation request may ask for is bounded
(stop lists, generated tokens), odd chat messages and logit_bias keys answer 400 or render,
and every field has its JSON type. Each reproduction of issue 26 runs against the shared
SmolLM2 server (or the default model's, for the pooling routes)."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

TIMEOUT = 120


def _post(server, route: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return httpx.post(f"{server.url}{route}", content=body, headers=headers, timeout=TIMEOUT)
    return httpx.post(f"{server.url}{route}", json=body, timeout=TIMEOUT)


def _refused(response: httpx.Response, *words: str) -> str:
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return message


# ---- 1) stop lists -------------------------------------------------------------------------


def test_a_huge_stop_list_is_refused_at_once(smollm2_server):
    rng = random.Random(0)
    stop = ["".join(rng.choice("abcdefghij") for _ in range(8)) for _ in range(200_000)]
    body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True}
    response = _post(smollm2_server, "/v1/completions", {**body, "stop": stop})
    _refused(response, "200000 strings", "limit of 64", "--max-stop-strings")
    long_stop = ["x" * 3000, "y" * 3000]
    response = _post(smollm2_server, "/v1/completions", {**body, "stop": long_stop})
    _refused(response, "6000 characters", "--max-stop-chars")
    response = _post(smollm2_server, "/v1/completions", {**body, "stop_token_ids": [5] * 65})
    _refused(response, "65 ids", "--max-stop-strings")


def test_stop_strings_at_the_bound_match_as_one_and_keep_health_answering(smollm2_server):
    body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}
    plain = _post(smollm2_server, "/v1/completions", body).json()["choices"][0]["text"]
    words = plain.split()
    assert len(words) > 6, plain
    target = words[5]
    rng = random.Random(1)
    decoys = ["".join(rng.choice("QZXJ") for _ in range(63)) for _ in range(63)]
    stop = [*decoys, target]  # 64 strings, 4,033 characters
    health: list[int] = []
    done = threading.Event()

    def poll_health() -> None:
        while not done.is_set():
            health.append(httpx.get(f"{smollm2_server.url}/health", timeout=30).status_code)
            time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        for stream in (False, True):
            response = _post(smollm2_server, "/v1/completions", {**body, "stop": stop,
                                                                  "stream": stream})  # fmt: skip
            assert response.status_code == 200, response.text
            if stream:
                events = [line[6:] for line in response.text.splitlines() if line[:6] == "data: "]
                chunks = [json.loads(e) for e in events[:-1]]
                text = "".join(c["text"] for chunk in chunks for c in chunk["choices"])
                reason = [c for chunk in chunks for c in chunk["choices"]][-1]["stop_reason"]
            else:
                choice = response.json()["choices"][0]
                text, reason = choice["text"], choice["stop_reason"]
            assert text == plain[: plain.index(target)] and reason == target
    finally:
        done.set()
        poller.join()
    assert health and set(health) == {200}


# ---- 4) chat messages without content, logit_bias keys ------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None,
          "tool_calls": []}, {"role": "user", "content": "Go on"}],
    ],
)  # fmt: skip
def test_chat_messages_without_content_render_as_empty(smollm2_server, messages):
    chat = _post(smollm2_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    tokens = _post(smollm2_server, "/tokenize", {"messages": messages})
    assert tokens.status_code == 200, tokens.text
    as_empty = [{**m, "content": m.get("content") or ""} for m in messages]
    assert tokens.json() == _post(smollm2_server, "/tokenize", {"messages": as_empty}).json()
    embedding = _post(smollm2_server, "/v1/embeddings", {"messages": messages})
    assert embedding.status_code == 200, embedding.text


def test_non_text_content_parts_are_a_400(smollm2_server):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    response = _post(smollm2_server, "/v1/chat/completions", {"messages": messages})
    _refused(response, "content part 0", "'image_url'")


def test_any_template_failure_is_invalid_input():
    from cenote.engine.chat import render_chat
    from cenote.errors import InvalidInputError

    template = "{{ messages[0]['content'] + messages[0]['name'] }}"  # str + int: a TypeError
    with pytest.raises(InvalidInputError, match="chat template failed.*TypeError"):
        render_chat(template, [{"role": "user", "content": "Hi", "name": 5}])


@pytest.mark.parametrize("key", ["²", "١", "５", " 5 ", "05", "-1", "+5", "5.0", ""])
def test_logit_bias_keys_are_ascii_token_ids(smollm2_server, key):
    body = {"prompt": "Hi", "max_tokens": 2, "logit_bias": {key: 1.0}}
    _refused(_post(smollm2_server, "/v1/completions", body), "logit_bias key")


def test_a_key_twice_in_one_object_is_refused(smollm2_server):
    body = b'{"prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": 1.0, "5": -100}}'
    _refused(_post(smollm2_server, "/v1/completions", body), "'5' twice")
    body = b'{"prompt": "Hi", "max_tokens": 2, "max_tokens": 4000}'
    _refused(_post(smollm2_server, "/v1/completions", body), "'max_tokens' twice")


# ---- 5) generated tokens -------------------------------------------------------------------


@pytest.mark.parametrize(
    "route, body, total",
    [
        ("/v1/completions", {"prompt": ["a"] * 2048, "max_tokens": 8000}, 2048 * 8000),
        ("/v1/completions", {"prompt": "a", "n": 4000, "max_tokens": 8000}, 4000 * 8000),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 4000},
         4000 * 4096),
        # chat without max_tokens asks for --default-max-tokens (4,096) per completion, not
        # the 8,170 tokens the context has left
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 65},
         65 * 4096),
    ],
)  # fmt: skip
def test_generated_tokens_are_bounded_per_request(smollm2_server, route, body, total):
    response = _post(smollm2_server, route, body)
    _refused(response, f"up to {total} generated tokens", "--max-request-generated-tokens")


def test_chat_at_the_generated_token_bound_is_taken(smollm2_server):
    # 64 x the default 4,096 is the bound itself; the stop strings end each answer early
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 64, "temperature": 0,
            "stop": ["!", ".", "?", ",", "\n"]}  # fmt: skip
    response = _post(smollm2_server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 64


# ---- 9) strict types -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("stream", 1), ("stream", "yes"), ("echo", "on"), ("ignore_eos", "true"),
     ("max_tokens", True), ("max_tokens", "1"), ("temperature", "0.5"), ("n", 1.0),
     ("logprobs", 2**64 - 1), ("seed", 2**63), ("top_k", True), ("priority", "1")],
)  # fmt: skip
def test_completion_fields_have_their_json_types(smollm2_server, field, value):
    body = {"prompt": "Hi", "max_tokens": 2, field: value}
    _refused(_post(smollm2_server, "/v1/completions", body), field)


@pytest.mark.parametrize(
    "body",
    [
        {"query": "q", "documents": ["d"], "top_n": 2**64 - 1},
        {"query": "q", "documents": ["d"], "max_tokens_per_doc": 2**64 - 1},
        {"query": "q", "documents": ["d"], "top_n": True},
        {"query": "q", "documents": ["d"], "return_documents": "yes"},
    ],
)
def test_rerank_fields_are_bounded_and_strict(default_server, body):
    response = _post(default_server, "/v1/rerank", body)
    assert response.status_code == 400, response.text


def test_the_schema_states_the_bounds(smollm2_server):
    spec = httpx.get(f"{smollm2_server.url}/openapi.json").json()
    schemas = spec["components"]["schemas"]
    rerank = schemas["RerankRequest"]["properties"]
    top_n = next(s for s in rerank["top_n"]["anyOf"] if s.get("type") == "integer")
    assert top_n["minimum"] == 0 and top_n["maximum"] > 2**62  # JSON renders 2**63 - 1 inexactly
    ref = schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]["$ref"]
    message = schemas[ref.rsplit("/", 1)[-1]]["properties"]
    assert set(message["role"]["enum"]) == {"system", "user", "assistant", "tool", "developer"}
