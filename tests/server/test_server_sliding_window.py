"""A sliding-window decoder (Mistral v0.1 style) through a real ``cenote serve``: greedy
completions token-identical to transformers' ``generate`` well past the window, alone and
batched, with prefills chunked across the window by a small token budget."""

from __future__ import annotations

import httpx
import pytest
from factories.generation import hf_greedy, random_prompts
from server_fixture import ServerProcess
from test_sliding_window import make_sliding_decoder

WINDOW = 8
MAX_NEW = 24  # prompts of 3 to 21 tokens end 27 to 45 tokens long: several windows


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory: pytest.TempPathFactory):
    """(server, prompts, transformers' greedy tokens); an 8-token budget chunks every prompt
    longer than the window and mixes those chunks with other requests' decodes."""
    folder = tmp_path_factory.mktemp("mistral_serve")
    theirs = make_sliding_decoder(folder, "mistral", seed=2, sliding_window=WINDOW)
    prompts = random_prompts([3, 9, 21, 6], seed=4)
    expected = hf_greedy(theirs, prompts, MAX_NEW)
    server = ServerProcess(
        str(folder), "--dtype", "float32", "--num-threads", "1", "--max-num-batched-tokens", "8"
    )
    try:
        yield server, prompts, expected
    finally:
        server.stop()


def _complete(server: ServerProcess, prompt: list[int] | list[list[int]]) -> list[dict]:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return sorted(response.json()["choices"], key=lambda choice: choice["index"])


def test_greedy_completions_past_the_window_match_transformers(mistral_server) -> None:
    server, prompts, expected = mistral_server
    for prompt, tokens in zip(prompts, expected, strict=True):
        (choice,) = _complete(server, prompt)
        assert choice["token_ids"] == tokens
        assert choice["finish_reason"] == "length"


def test_batched_completions_past_the_window_match_transformers(mistral_server) -> None:
    server, prompts, expected = mistral_server
    choices = _complete(server, prompts)
    assert [choice["token_ids"] for choice in choices] == expected
