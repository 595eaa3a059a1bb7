"""Requests that used to kill the engine core answer a clear 4xx; the engine stays up.

Reproductions from the server-robustness issue, on the real SmolLM2 GGUF and the default model.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import tempfile
import threading
import time

import httpx
import pytest

from tests.server_fixture import wait_until

BIG = 18446744073709551616  # 2**64: outside every int64 field


@pytest.fixture(scope="module")
def gen(smollm2_server):
    with httpx.Client(base_url=smollm2_server.url, timeout=120) as client:
        yield client
        assert client.get("/health").status_code == 200


@pytest.fixture(scope="module")
def emb(default_server):
    with httpx.Client(base_url=default_server.url, timeout=120) as client:
        yield client
        assert client.get("/health").status_code == 200


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


def test_logprobs_above_the_vocabulary_is_400_not_a_dead_engine(gen):
    body = {"prompt": "a", "max_tokens": 1, "logprobs": 49153}
    assert "max_logprobs" in _error(gen.post("/v1/completions", json=body), 400)
    chat = {
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 1,
        "logprobs": True,
        "top_logprobs": 49153,
    }
    assert "49153" in _error(gen.post("/v1/chat/completions", json=chat), 400)
    ok = gen.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "logprobs": 20})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0])


def test_client_request_ids_never_collide_in_the_engine(smollm2_server):
    """A completion with request_id "rid" and n=2 in flight, then an embedding with "rid-0"."""

    async def run() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=smollm2_server.url, timeout=120) as client:
            before = smollm2_server.num_steps()
            completion = asyncio.create_task(
                client.post(
                    "/v1/completions",
                    json={"prompt": "a b c", "max_tokens": 24, "n": 2, "request_id": "rid"},
                )
            )
            await asyncio.to_thread(smollm2_server.wait_for_steps, before)  # in flight
            embedding = client.post("/v1/embeddings", json={"input": "x", "request_id": "rid-0"})
            same = client.post("/v1/embeddings", json={"input": "y", "request_id": "rid"})
            return await completion, await embedding, await same

    completion, embedding, same = asyncio.run(run())
    assert completion.status_code == 200 and len(completion.json()["choices"]) == 2
    assert completion.json()["id"] == "rid"  # the client's id is echoed, never used as a key
    assert embedding.status_code == 200 and embedding.json()["id"] == "rid-0"
    assert same.status_code == 200 and same.json()["id"] == "rid"


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/embeddings", {"input": "hi", "priority": BIG}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": BIG}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [BIG]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [49153]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": -BIG}),
    ],
)
def test_integers_outside_their_wire_type_are_400(gen, route, body):
    response = gen.post(route, json=body)
    assert response.status_code == 400, response.text


# ---- bounded work per request ----------------------------------------------------------------


def test_token_embed_amplification_is_refused_before_running(emb):
    """256 inputs x 256 token ids (a 0.4 MB body) would answer ~500 MB of JSON."""
    body = {"task": "token_embed", "input": [[1000 + i for i in range(256)]] * 256}
    message = _error(emb.post("/pooling", json=body), 400)
    assert "25165824 numbers" in message and "--max-response-values" in message


def test_a_request_over_the_token_bound_is_400(emb):
    body = {"input": ["word " * 300] * 300, "truncate_prompt_tokens": -1}  # 300 x 256 tokens
    message = _error(emb.post("/v1/embeddings", json=body), 400)
    assert "76800 tokens" in message and "--max-request-tokens" in message


def test_small_requests_flow_while_a_maximal_one_runs(default_server):
    """A maximal request keeps one share of the core's queue (the rest is held): a small
    request sent after it is answered before it, and /health answers meanwhile."""
    big = {"input": ["word " * 300] * 256, "truncate_prompt_tokens": -1}  # 65,536 tokens

    async def run() -> list[str]:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=default_server.url, timeout=300) as client:

            async def send(name: str, body: dict) -> None:
                response = await client.post("/v1/embeddings", json=body)
                assert response.status_code == 200, response.text
                order.append(name)

            before = default_server.num_steps()
            big_task = asyncio.create_task(send("big", big))
            await asyncio.to_thread(default_server.wait_for_steps, before)  # big is running
            health = await client.get("/health")
            assert health.status_code == 200
            await asyncio.gather(*(send(f"small{i}", {"input": "a query"}) for i in range(3)))
            await big_task
        return order

    order = asyncio.run(run())
    assert order[-1] == "big", order


# ---- clean ends --------------------------------------------------------------------------------


def _health(server) -> httpx.Response:
    return httpx.get(f"{server.url}/health", timeout=10)


def _ipc_dirs() -> set[str]:
    import glob

    return set(glob.glob(os.path.join(tempfile.gettempdir(), "cenote-ipc-*")))


def test_a_step_keeps_the_heartbeat_going_however_long_it_runs():
    """The core's heartbeat thread beats through a step (here 1.2 s, beats every 0.1 s) and
    falls silent between steps, where the idle loop beats instead."""
    import zmq

    from cenote.engine.core_proc import StepHeartbeat
    from cenote.engine.ipc import Heartbeat, output_decoder

    context = zmq.Context()
    front = context.socket(zmq.PULL)
    front.bind("inproc://heartbeat-test")
    decoder = output_decoder()

    def beats(wait_s: float) -> int:
        count, deadline = 0, time.monotonic() + wait_s
        while front.poll(max(int((deadline - time.monotonic()) * 1000), 0)):
            assert isinstance(decoder.decode(front.recv()), Heartbeat)
            count += 1
        return count

    try:
        with StepHeartbeat(context, "inproc://heartbeat-test", interval=0.1) as heartbeat:
            assert beats(0.3) == 0  # idle: not this thread's to say
            with heartbeat.during_step():
                time.sleep(1.2)  # a long step (torch releases the GIL in its kernels)
            assert beats(0.0) >= 5
            assert beats(0.3) == 0
    finally:
        front.close(linger=0)
        context.term()


def test_long_prompt_logprobs_run_in_bounded_steps_while_health_answers(gen, smollm2_server):
    """A prompt asking for prompt logprobs is computed 512 tokens a step (the default
    --max-prompt-logprobs-tokens): every step's outputs (and heartbeats) reach the front, and
    /health answers 200 all along."""
    body = {"prompt": "word " * 600, "max_tokens": 1, "prompt_logprobs": 5}
    result = {}

    def send() -> None:
        result["response"] = gen.post("/v1/completions", json=body)

    before = smollm2_server.num_steps()
    thread = threading.Thread(target=send)
    thread.start()
    health = []
    while thread.is_alive():
        health.append(httpx.get(f"{smollm2_server.url}/health", timeout=10).status_code)
        thread.join(0.2)
    response = result["response"]
    assert response.status_code == 200, response.text
    answer = response.json()
    entries = answer["choices"][0]["prompt_logprobs"]
    assert len(entries) == answer["usage"]["prompt_tokens"] > 512 and entries[0] is None
    assert all(1 <= len(e) <= 6 for e in entries[1:])
    assert set(health) == {200}
    assert smollm2_server.num_steps() - before >= 2  # over 512 prompt tokens, 512 a step


def test_hung_core_fails_health_and_a_group_signal_drains_and_exits_0():
    """SIGSTOP of the core: /health says hung (heartbeat deadline), then recovers on SIGCONT.
    Steps longer than the deadline are not a hung core: /health stays 200 through them.
    SIGTERM to the whole process group (Ctrl-C in a terminal sends SIGINT the same way): the
    in-flight request is answered, exit 0, no traceback, the IPC directory removed."""
    from tests.server_fixture import ServerProcess

    before = _ipc_dirs()
    server = ServerProcess(
        "--dtype", "float32", "--num-threads", "1", "--engine-heartbeat-timeout", "1.5"
    )  # fmt: skip
    created = _ipc_dirs() - before
    try:
        core = server.engine_pid()
        os.kill(core, signal.SIGSTOP)
        try:
            wait_until(lambda: _health(server).status_code == 503, "hung /health", 20)
            assert "hung" in _health(server).json()["error"]["message"]
        finally:
            os.kill(core, signal.SIGCONT)
        wait_until(lambda: _health(server).status_code == 200, "heartbeat", 20)

        result = {}
        body = {"input": ["word " * 300] * 128, "truncate_prompt_tokens": -1}

        def send() -> None:
            result["response"] = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=120)

        before = server.num_steps()
        thread = threading.Thread(target=send)
        thread.start()
        server.wait_for_steps(before)  # in flight
        # its steps (8,192 tokens on one thread) outlast the 1.5 s deadline: the core beats on
        health = []
        for _ in range(10):
            health.append(_health(server).status_code)
            time.sleep(0.25)
        assert set(health) == {200}, health
        os.killpg(server.process.pid, signal.SIGTERM)
        thread.join(120)
        assert result["response"].status_code == 200
        assert len(result["response"].json()["data"]) == 128
        assert server.process.wait(60) == 0
        log = server.log()
        assert "Traceback" not in log and "unexpectedly" not in log, log[-3000:]
        assert created and not any(os.path.exists(d) for d in created)
    finally:
        server.stop()


def test_a_slow_client_is_disconnected_and_others_are_served():
    """One header line per second never completes a request: the connection is closed at the
    read deadline, while other clients are answered."""
    import socket

    from tests.server_fixture import ServerProcess

    server = ServerProcess("--dtype", "float32", "--num-threads", "1", "--read-timeout", "2")
    try:
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 10:
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            try:
                slow.sendall(b"X-Slow: 1\r\n")
                slow.settimeout(1.0)
                if slow.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed, "the slow client was never disconnected"
        slow.close()
    finally:
        server.stop()


def test_an_empty_document_is_named_as_a_document(gen):
    """SmolLM2 (no special tokens) as a bi-encoder: an empty document has 0 tokens."""
    body = {"query": "rivers", "documents": ["a river", ""]}
    assert "document 1 is empty" in _error(gen.post("/v1/rerank", json=body), 400)


def test_stream_options_without_stream_is_400(gen):
    body = {"prompt": "a", "max_tokens": 1, "stream_options": {"include_usage": True}}
    assert "stream_options" in _error(gen.post("/v1/completions", json=body), 400)


def test_echo_of_token_ids_keeps_their_special_tokens(gen):
    """SmolLM2: id 1 is <|im_start|>; an echoed token-id prompt reads as its text, specials kept."""
    ids = [1, *gen.post("/tokenize", json={"prompt": "user"}).json()["tokens"]]
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "temperature": 0}
    response = gen.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith("<|im_start|>user")


@pytest.mark.parametrize("route", ["/v1/embeddings", "/pooling", "/v1/chat/completions"])
def test_a_chat_over_max_input_chars_once_rendered_is_400(gen, route):
    """--max-input-chars (default 1 MiB) holds chat messages as the template renders them: a
    message just under the limit is over it once SmolLM2's template wraps it."""
    limit = 1 << 20
    content = "a" * (limit - 4)
    body: dict = {"messages": [{"role": "user", "content": content}]}
    if route == "/v1/chat/completions":
        body["max_tokens"] = 1
    message = _error(gen.post(route, json=body), 400)
    match = re.fullmatch(
        rf"prompt 0 \(rendered\) has (\d+) characters, more than the limit of {limit} "
        r"\(max_input_chars\)",
        message,
    )
    assert match and int(match.group(1)) > limit, message


def test_a_text_over_max_input_chars_is_400(emb):
    limit = 1 << 20
    body = {"input": ["a cat", "a" * (limit + 1)]}
    message = _error(emb.post("/v1/embeddings", json=body), 400)
    expected = f"prompt 1 has {limit + 1} characters, more than the limit of {limit}"
    assert message == f"{expected} (max_input_chars)"


def test_suffix_is_400(gen):
    body = {"prompt": "a", "suffix": "b", "max_tokens": 1}
    message = _error(gen.post("/v1/completions", json=body), 400)
    assert message == "suffix is not supported: cenote does not fill in the middle"


def test_an_invocations_body_that_is_not_an_object_is_400(emb):
    message = _error(emb.post("/invocations", json=["a cat"]), 400)
    assert message == "the request body must be a JSON object"


def test_a_scoring_text_over_max_input_chars_is_400(emb):
    limit = 1 << 20
    body = {"text_1": "a cat", "text_2": ["a dog", "a" * (limit + 1)]}
    message = _error(emb.post("/score", json=body), 400)
    assert message == f"text_2[1] has {limit + 1} characters, the limit is {limit}"
