"""LoRA adapters on the server: ``--lora-modules name=path``, a request's ``model`` picks one
on every route (and is echoed), ``/v1/models`` lists them with ``parent``, an unknown name is a
404 (vLLM); ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` behind
``--enable-lora-runtime-updating``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from factories.decoders import make_decoder
from factories.generation import hf_greedy, random_prompts
from factories.lora import write_adapter, write_head_adapter
from server_fixture import ServerProcess
from starlette.testclient import TestClient

MAX_NEW = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("server_lora")
    base = make_decoder(root / "base", "llama")
    merged = {
        "sql": write_adapter(
            base, root / "sql", 1, ["q_proj", "v_proj", "down_proj"], r=4, lora_alpha=8
        ),
        "chat": write_adapter(base, root / "chat", 2, ["gate_proj", "up_proj"], r=2, lora_alpha=8),
    }
    server = ServerProcess(
        str(root / "base"), "--dtype", "float32", "--num-threads", "1",
        "--served-model-name", "base", "--max-lora-rank", "8",
        "--lora-modules", f"sql={root / 'sql'}", f"chat={root / 'chat'}",
        "--enable-lora-runtime-updating",
        "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )  # fmt: skip
    try:
        yield server, base, merged, root
    finally:
        server.stop()


def test_models_lists_adapters_with_their_parent(served) -> None:
    server, *_ = served
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [
        ("base", None),
        ("sql", "base"),
        ("chat", "base"),
    ]
    assert httpx.get(f"{server.url}/v1/models/sql").json()["parent"] == "base"


def test_model_field_picks_the_adapter(served) -> None:
    server, base, merged, _ = served
    prompt = random_prompts([9], seed=4)[0]
    for name, model in [("base", base), *merged.items()]:
        body = {
            "model": name, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
            "return_token_ids": True,
        }  # fmt: skip
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        tokens = response.json()["choices"][0]["token_ids"]
        assert tokens == hf_greedy(model, [prompt], MAX_NEW)[0], name


def test_unknown_model_is_a_404_naming_the_served_ones(served) -> None:
    server, *_ = served
    body = {"model": "nope", "prompt": "a", "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "'nope'" in message and "'sql'" in message and "'chat'" in message
    assert httpx.get(f"{server.url}/v1/models/nope").status_code == 404
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_bad_lora_modules_entry_is_refused_at_start(tmp_path: Path) -> None:
    from cenote.config import parse_lora_modules

    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["no-equals-sign"])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _complete(server: ServerProcess, model: str, prompt: list[int], **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
            "return_token_ids": True, **extra}  # fmt: skip
    return _post(server, "/v1/completions", body)


def test_responses_echo_the_adapter_name(served) -> None:
    server, *_ = served
    prompt = random_prompts([5], seed=6)[0]
    assert _complete(server, "sql", prompt).json()["model"] == "sql"
    assert _complete(server, "base", prompt).json()["model"] == "base"
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = _post(server, "/v1/chat/completions", chat)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "chat"


def test_load_then_use_then_unload(served) -> None:
    server, base, _, root = served
    merged = write_adapter(
        base, root / "late", 5, ["k_proj", "o_proj", "up_proj"], r=8, lora_alpha=4
    )
    response = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(root / "late")}
    )
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'late' added successfully."
    assert response.headers["content-type"].startswith("text/plain")
    cards = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert ("late", "base") in [(m["id"], m["parent"]) for m in cards]
    prompt = random_prompts([9], seed=7)[0]
    answer = _complete(server, "late", prompt).json()
    assert answer["model"] == "late"
    assert answer["choices"][0]["token_ids"] == hf_greedy(merged, [prompt], MAX_NEW)[0]

    duplicate = {"lora_name": "late", "lora_path": str(root / "sql")}
    response = _post(server, "/v1/load_lora_adapter", duplicate)
    assert response.status_code == 400 and "already been loaded" in response.text
    response = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "base", "lora_path": str(root / "sql")}
    )
    assert response.status_code == 400 and "name of a served model" in response.text

    response = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'late' removed successfully."
    assert _complete(server, "late", prompt).status_code == 404
    assert httpx.get(f"{server.url}/v1/models/late").status_code == 404
    response = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert response.status_code == 404 and "'late' cannot be found" in response.text


def test_unloading_an_adapter_in_use_lets_its_requests_finish(served) -> None:
    """Unload answers at once and new requests naming the adapter get 404; a request already
    running under it (its first streamed tokens seen) finishes under it, token for token."""
    server, base, _, root = served
    merged = write_adapter(base, root / "busy", 6, ["q_proj", "down_proj"], r=4, lora_alpha=8)
    body = {"lora_name": "busy", "lora_path": str(root / "busy")}
    assert _post(server, "/v1/load_lora_adapter", body).status_code == 200
    prompt, length = random_prompts([7], seed=8)[0], 96
    stream_body = {"model": "busy", "prompt": prompt, "max_tokens": length, "temperature": 0,
                   "ignore_eos": True, "return_token_ids": True, "stream": True}  # fmt: skip
    tokens: list[int] = []
    unloaded = None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=stream_body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert chunk["model"] == "busy"
            tokens += chunk["choices"][0].get("token_ids") or []
            if unloaded is None:  # the request runs under the adapter: unload it now
                unloaded = _post(server, "/v1/unload_lora_adapter", {"lora_name": "busy"})
                assert _complete(server, "busy", prompt).status_code == 404
    assert unloaded is not None and unloaded.status_code == 200, unloaded
    assert tokens == hf_greedy(merged, [prompt], length)[0]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_bad_adapters_are_refused_and_the_engine_serves_on(served, tmp_path: Path) -> None:
    server, base, _, root = served
    response = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "absent")}
    )
    assert response.status_code == 404 and "no LoRA adapter found" in response.text
    write_adapter(base, tmp_path / "big", 3, ["q_proj"], r=16, lora_alpha=16)
    response = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(tmp_path / "big")}
    )
    assert response.status_code == 400
    assert "rank 16" in response.text and "max_lora_rank=8" in response.text
    other = make_decoder(tmp_path / "other", "llama", hidden_size=32, head_dim=8)
    write_adapter(other, tmp_path / "other_adapter", 3, ["q_proj"], r=4, lora_alpha=8)
    body = {"lora_name": "other", "lora_path": str(tmp_path / "other_adapter")}
    response = _post(server, "/v1/load_lora_adapter", body)
    assert response.status_code == 400
    assert "does not fit this base model" in response.text and "(64, 64)" in response.text
    write_adapter(base, tmp_path / "dora", 3, ["q_proj"], r=4, lora_alpha=8, use_dora=True)
    response = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "dora", "lora_path": str(tmp_path / "dora")}
    )
    assert response.status_code == 400 and "DoRA" in response.text
    # a saved full module (modules_to_save) that is no classification head of this model
    write_head_adapter(base, tmp_path / "norm", 3, ["q_proj"], ["norm"], r=4, lora_alpha=8)
    response = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "norm", "lora_path": str(tmp_path / "norm")}
    )
    assert response.status_code == 400 and "modules_to_save" in response.text
    assert "no classification head" in response.text
    response = _post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert response.status_code == 400 and "lora_path" in response.text
    names = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert names == ["base", "sql", "chat"]
    prompt = random_prompts([5], seed=9)[0]
    assert _complete(server, "sql", prompt).status_code == 200


def test_runtime_routes_need_the_flag_and_the_api_key(served) -> None:
    """Without --enable-lora-runtime-updating the routes are not mounted (404, as vLLM's);
    with it they sit behind the API key like every route. In-process, no engine started."""
    from cenote.engine_args import EngineArgs
    from cenote.server.app import build_app
    from cenote.server.served_models import ServedModels
    from cenote.server.state import ServerOptions, ServerState

    _, _, _, root = served
    config = EngineArgs.from_options(
        str(root / "base"), {"dtype": "float32"}
    ).create_engine_config()
    for options, status in [
        (ServerOptions(), 404),  # GET: no such route
        (ServerOptions(enable_lora_runtime_updating=True), 405),  # the route is POST-only
        (ServerOptions(enable_lora_runtime_updating=True, api_key="k"), 401),
    ]:
        state = ServerState(config, options)
        try:
            client = TestClient(build_app(ServedModels([state])))
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                assert client.get(path).status_code == status, (options, path)
            if options.api_key:
                body = {"lora_name": "a", "lora_path": "/x"}
                assert client.post("/v1/load_lora_adapter", json=body).status_code == 401
        finally:
            state._blocking.shutdown()
