"""The server's front without an engine: what it answers before the model is loaded and after
the engine died, and options it refuses — the app in this process, no engine started."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from cenote.engine_args import EngineArgs
from cenote.server.app import build_app
from cenote.server.served_models import ServedModels
from cenote.server.state import ServerOptions, ServerState


@pytest.fixture(scope="module")
def engine_config():
    return EngineArgs.from_options(None, {"dtype": "float32"}).create_engine_config()


def _error(response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == status
    return response.json()["error"]["message"]


def test_requests_before_the_engine_is_up_and_after_it_died_are_503(engine_config) -> None:
    state = ServerState(engine_config, ServerOptions())
    client = TestClient(build_app(ServedModels([state])))  # no lifespan: the engine never starts
    try:
        response = client.post("/v1/embeddings", json={"input": "a"})
        assert _error(response, 503) == "the server is starting; the model is not loaded yet"
        assert _error(client.get("/health"), 503) == "not ready: starting"
        state.client.mark_dead("the core exited")
        response = client.post("/v1/embeddings", json={"input": "a"})
        assert _error(response, 503) == "the engine is not running: the core exited"
        assert _error(client.get("/health"), 503) == "not ready: the core exited"
    finally:
        state._blocking.shutdown()


def test_data_parallel_size_below_one_is_refused(engine_config) -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1, got 0"):
        ServerState(engine_config, ServerOptions(data_parallel_size=0))
