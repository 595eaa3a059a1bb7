"""Connection admission of ``cenote serve`` (issue 26, item 6): sockets that never send a byte or
sit idle between requests never deny service; a silent socket is closed at the first-byte
timeout; one client address over its cap is refused while others are served; ``/health`` and
``/metrics`` are answered even when every request slot is busy.

Loopback accepts the whole 127/8, so client sockets bound to 127.0.0.N are distinct client
addresses. One small server for the module: 8 busy connections, 16 per address."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.server_fixture import ServerProcess, free_port, wait_until

MAX_BUSY = 8
PER_CLIENT = 16
FIRST_BYTE_S = 1.0


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    server = ServerProcess(
        "--dtype", "float32", "--num-threads", "1", "--max-connections", str(MAX_BUSY),
        "--max-connections-per-client", str(PER_CLIENT), "--first-byte-timeout", str(FIRST_BYTE_S),
        "--keep-alive-timeout", "120",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def _client(server: ServerProcess, address: str) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(
        "127.0.0.1", server.port, timeout=60, source_address=(address, 0)
    )


def _get(connection: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, response.read()


def _silent(server: ServerProcess, address: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), source_address=(address, 0))


def _embed(server: ServerProcess, address: str = "127.0.0.1") -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=address)
    with httpx.Client(transport=transport, timeout=60) as client:
        return client.post(f"{server.url}/v1/embeddings", json={"input": ["a cat"]})


def test_idle_connections_never_count_against_the_cap(server):
    """Beyond --max-connections: 12 keep-alive connections idle after their answer and 12 that
    never sent a byte. /health and a real request are answered 200."""
    with contextlib.ExitStack() as stack:
        for i in range(12):
            idle = stack.enter_context(contextlib.closing(_client(server, f"127.0.0.{2 + i % 3}")))
            assert _get(idle, "/health")[0] == 200  # now idle, kept alive
        for i in range(12):
            stack.enter_context(_silent(server, f"127.0.0.{5 + i % 3}"))
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        response = _embed(server)
        assert response.status_code == 200, response.text
        assert len(response.json()["data"][0]["embedding"]) == 384


def test_a_silent_connection_is_closed_at_the_first_byte_timeout(server):
    """Far sooner than --read-timeout (30 s): recv sees the close."""
    with _silent(server, "127.0.0.8") as silent:
        silent.settimeout(15)
        assert silent.recv(1) == b""


def test_one_address_over_its_cap_is_refused_and_others_are_served(server):
    with contextlib.ExitStack() as stack:
        held = []
        for _ in range(PER_CLIENT):
            connection = stack.enter_context(contextlib.closing(_client(server, "127.0.0.9")))
            assert _get(connection, "/health")[0] == 200  # open and idle: counted per address
            held.append(connection)
        over = stack.enter_context(contextlib.closing(_client(server, "127.0.0.9")))
        status, body = _get(over, "/health")
        assert status == 503
        message = httpx.Response(503, content=body).json()["error"]["message"]
        assert f"127.0.0.9 has {PER_CLIENT} connections open" in message
        assert f"limit per client address is {PER_CLIENT}" in message
        assert _embed(server, "127.0.0.10").status_code == 200  # another address: served
        held[0].close()  # a slot of this address frees once the server sees the close

        def served_again() -> bool:
            with contextlib.closing(_client(server, "127.0.0.9")) as again:
                with contextlib.suppress(OSError, http.client.HTTPException):
                    return _get(again, "/health")[0] == 200
            return False

        wait_until(served_again, "a connection of 127.0.0.9 served after one closed", 30)


def test_health_and_metrics_are_answered_when_every_slot_is_busy(server):
    """8 connections send half a request head and stop (busy until --read-timeout): another
    request is answered 503 with Retry-After; /health and /metrics still 200."""
    with contextlib.ExitStack() as stack:
        for i in range(MAX_BUSY):
            slow = stack.enter_context(_silent(server, f"127.0.0.{11 + i % 2}"))
            slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
        wait_until(lambda: _embed(server).status_code == 503, "a 503 past the busy cap", 30)
        response = _embed(server)
        assert response.headers["retry-after"] == "1"
        message = response.json()["error"]["message"]
        assert f"the limit is {MAX_BUSY} (--max-connections)" in message
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200
    wait_until(lambda: _embed(server).status_code == 200, "requests served again", 30)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--first-byte-timeout", "0", "--first-byte-timeout must be > 0 seconds, got 0.0"),
        ("--max-connections-per-client", "0", "--max-connections-per-client must be >= 1, got 0"),
        ("--max-connections", "-1", "--max-connections must be >= 1, got -1"),
    ],
)
def test_impossible_connection_limits_exit_2_before_the_model_loads(flag, value, message):
    done = subprocess.run(
        [sys.executable, "-m", "cenote", "serve", "/nonexistent/model", flag, value,
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "/nonexistent/model" not in done.stderr  # refused before looking for the model
