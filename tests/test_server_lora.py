"""LoRA adapters on the server: ``--lora-modules name=path``, a request's ``model`` picks one
on every route, ``/v1/models`` lists them with ``parent``, an unknown name is a 404 (vLLM)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from factories.decoders import make_decoder
from factories.generation import hf_greedy, random_prompts
from factories.lora import write_adapter
from server_fixture import ServerProcess

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
    )  # fmt: skip
    try:
        yield server, base, merged
    finally:
        server.stop()


def test_models_lists_adapters_with_their_parent(served) -> None:
    server, _, _ = served
    data = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [
        ("base", None),
        ("sql", "base"),
        ("chat", "base"),
    ]
    assert httpx.get(f"{server.url}/v1/models/sql").json()["parent"] == "base"


def test_model_field_picks_the_adapter(served) -> None:
    server, base, merged = served
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
    server, _, _ = served
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
