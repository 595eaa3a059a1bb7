"""``cenote serve --models-dir DIR``: every model folder and ``.gguf`` file under DIR is served by
name and loaded by its first request (concurrent first requests share one load), answering as
the offline engine does; ``/v1/models`` says which are loaded; ``--max-loaded-models`` unloads
the least recently used idle model to make room; ``--idle-unload-seconds`` unloads an unused
model and its engine core exits; an unload waits for the requests in flight; ``POST
/models/load`` / ``/models/unload`` sit behind the API key; a folder whose weights do not load
is a 503 naming the cause while the others serve; a name served twice is a start-up error."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil

import gguf
import httpx
import pytest
import torch

from cenote.cli.main import _parser, _served_models
from cenote.cli.model_specs import model_specs
from cenote.server.state import ServerOptions
from tests.factories.decoders import make_decoder
from tests.factories.gguf import write_encoder_gguf
from tests.server_fixture import ServerProcess, wait_until

API_KEY = "models-dir-key"
TEXTS = ["a cat sat on the mat", "quantum chromodynamics"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, minilm_path, cross_encoder_dir):
    """embedder (MiniLM's folder), minilm-gguf (the same as a GGUF file), writer (a tiny
    Llama), broken (config and tokenizer read, weights do not); a folder without config.json
    and a text file are no models."""
    root = tmp_path_factory.mktemp("models_dir")
    models = root / "models"
    models.mkdir()
    (models / "embedder").symlink_to(minilm_path, target_is_directory=True)
    write_encoder_gguf(minilm_path, models / "minilm-gguf.gguf", gguf.MODEL_ARCH.BERT)
    make_decoder(models / "writer", "llama", seed=3)
    broken = models / "broken"
    shutil.copytree(cross_encoder_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    (models / "notes").mkdir()
    (models / "notes" / "README.md").write_text("no model here")
    (models / "list.txt").write_text("not a model")
    return models


@pytest.fixture(scope="module")
def server(models_dir, cross_encoder_dir):
    """The folder's models on demand (two loaded at most) beside an always-loaded reranker."""
    process = ServerProcess(
        "--models-dir", str(models_dir), "--model", f"reranker={cross_encoder_dir}",
        "--max-loaded-models", "2", "--dtype", "float32", api_key=API_KEY, timeout_s=120,
    )  # fmt: skip
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        yield client


def _status(http: httpx.Client) -> dict[str, str]:
    return {card["id"]: card["status"]["value"] for card in http.get("/v1/models").json()["data"]}


def _embed(http: httpx.Client, model: str) -> torch.Tensor:
    response = http.post("/v1/embeddings", json={"model": model, "input": TEXTS})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return torch.tensor([row["embedding"] for row in response.json()["data"]])


def test_every_model_of_the_folder_is_listed_unloaded(http):
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert list(cards) == ["reranker", "broken", "embedder", "minilm-gguf", "writer"]
    assert cards["reranker"]["status"] == {"value": "loaded"}
    for name in ("broken", "embedder", "minilm-gguf", "writer"):
        assert cards[name]["status"] == {"value": "unloaded"}
        assert cards[name]["max_model_len"] is None and cards[name]["supported_tasks"] == []
    assert http.get("/v1/models/writer").json()["status"] == {"value": "unloaded"}
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["models"]["embedder"] == {"status": "unloaded"}


def test_first_requests_share_one_load_and_answer_as_the_offline_engine(http, server, llm_fp32):
    expected = torch.stack([out.outputs.data for out in llm_fp32.embed(TEXTS)])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: _embed(http, "embedder"), range(3)))
    for got in answers:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert server.log().count("loading model 'embedder'") == 1
    card = http.get("/v1/models/embedder").json()
    assert card["status"] == {"value": "loaded"} and "embed" in card["supported_tasks"]
    assert card["max_model_len"] == 256  # sentence-transformers max_seq_length


def test_a_gguf_file_is_served_by_its_stem(http, llm_fp32):
    expected = torch.stack([out.outputs.data for out in llm_fp32.embed(TEXTS)])
    torch.testing.assert_close(_embed(http, "minilm-gguf"), expected, atol=1e-4, rtol=0)
    assert _status(http)["minilm-gguf"] == "loaded"


def test_loading_past_the_bound_unloads_the_least_recently_used_idle_model(http, server):
    """Two loaded (embedder, then minilm-gguf, used last); a third unloads the embedder."""
    _embed(http, "minilm-gguf")  # the embedder is now the least recently used
    body = {"model": "writer", "prompt": "w5 w6", "max_tokens": 4, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    status = _status(http)
    assert (status["embedder"], status["minilm-gguf"], status["writer"]) == (
        "unloaded", "loaded", "loaded",
    )  # fmt: skip
    assert "unloading model 'embedder' (least recently used" in server.log()
    assert len(server.engine_pids()) == 3  # the reranker's core and the two loaded ones


def test_an_unload_waits_for_the_request_in_flight(http, server):
    """A stream is in flight on the writer when it is unloaded: the stream ends whole, then
    the model unloads."""
    _embed(http, "minilm-gguf")  # the writer stays loaded (it is not the least recently used)
    body = {"model": "writer", "prompt": "w5 w6", "max_tokens": 250, "n": 4, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        http.stream("POST", "/v1/completions", json=body) as stream,
    ):
        assert stream.status_code == 200, stream.read()
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        unload = pool.submit(http.post, "/models/unload", json={"model": "writer"})
        wait_until(lambda: "unloading model 'writer' (asked" in server.log(), "the unload")
        assert _status(http)["writer"] == "unloading"
        events = [first, *(line for line in lines if line.startswith("data: "))]
        assert unload.result().status_code == 200, unload.result().text
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]].count("length") == 4
    assert chunks[-1]["usage"]["completion_tokens"] == 4 * 250  # every token, nothing cut
    assert "unloading model 'writer' (asked by POST /models/unload); waiting for 1 request(s)" in (
        server.log()
    )
    assert unload.result().json() == {"model": "writer", "status": "unloaded"}
    assert _status(http)["writer"] == "unloaded"


def test_admin_routes_need_the_key_and_refuse_with_reasons(http, server):
    assert httpx.post(f"{server.url}/models/load", json={"model": "embedder"}).status_code == 401
    unknown = http.post("/models/load", json={"model": "nope"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == (
        "the model 'nope' does not exist; this server serves 'reranker', 'broken', 'embedder', "
        "'minilm-gguf', 'writer'"
    )
    always = http.post("/models/unload", json={"model": "reranker"})
    assert always.status_code == 400 and "always loaded" in always.json()["error"]["message"]
    not_loaded = http.post("/models/unload", json={"model": "embedder"})
    assert not_loaded.status_code == 409
    assert not_loaded.json()["error"]["message"] == (
        "the model 'embedder' is not loaded (it is unloaded)"
    )
    assert http.post("/models/load", json={}).status_code == 400
    loaded = http.post("/models/load", json={"model": "embedder"})
    assert loaded.status_code == 200 and loaded.json() == {"model": "embedder", "status": "loaded"}
    assert _status(http)["embedder"] == "loaded"


def test_unknown_model_is_404_listing_every_served_name(http):
    response = http.post("/v1/embeddings", json={"model": "nope", "input": "a"})
    assert response.status_code == 404
    assert "'reranker', 'broken', 'embedder', 'minilm-gguf', 'writer'" in response.text


def test_a_broken_folder_is_503_naming_the_cause_while_the_others_serve(http):
    for _ in range(2):  # the second is answered at once: the failure is remembered
        response = http.post(
            "/v1/rerank", json={"model": "broken", "query": "a", "documents": ["b"]}
        )
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert message.startswith("the model 'broken' failed to load: ")
        assert "safetensors" in message or "header" in message, message
    card = http.get("/v1/models/broken").json()
    assert card["status"]["value"] == "failed" and card["status"]["reason"]
    health = http.get("/health").json()
    assert health["status"] == "degraded" and health["models"]["broken"]["status"] == "failed"
    rerank = http.post("/v1/rerank", json={"model": "reranker", "query": "a", "documents": ["b"]})
    assert rerank.status_code == 200
    assert http.post("/v1/embeddings", json={"model": "embedder", "input": "a"}).status_code == 200


def test_a_name_served_twice_is_a_start_up_error(models_dir, cross_encoder_dir):
    args = _parser().parse_args(
        ["serve", "--models-dir", str(models_dir), "--model", f"writer={cross_encoder_dir}"]
    )
    options = ServerOptions(models_dir=str(models_dir))
    with pytest.raises(ValueError, match="the model name 'writer' is served twice: by --model"):
        _served_models(model_specs(args), options)


def _tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (MiB)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = open(f"/proc/{current}/status").read()
            for task in os.listdir(f"/proc/{current}/task"):
                pending += [
                    int(c) for c in open(f"/proc/{current}/task/{task}/children").read().split()
                ]
        except FileNotFoundError:
            continue
        total += int(status.split("VmRSS:")[1].split()[0]) if "VmRSS:" in status else 0
    return total / 1024


def test_an_idle_model_is_unloaded_and_its_memory_returns(tmp_path, minilm_path):
    """``--idle-unload-seconds 1``: the embedder unloads by itself a second after its request;
    its engine core exits and the server's memory is back near what it was before the load."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "embedder").symlink_to(minilm_path, target_is_directory=True)
    server = ServerProcess("--models-dir", str(folder), "--idle-unload-seconds", "1",
                           "--dtype", "float32")  # fmt: skip
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            before = _tree_rss_mib(server.process.pid)
            _embed(http, "embedder")
            loaded = _tree_rss_mib(server.process.pid)
            core = server.engine_pid()
            wait_until(lambda: _status(http)["embedder"] == "unloaded", "the idle unload", 30)
            wait_until(lambda: not os.path.exists(f"/proc/{core}"), "the core's exit", 30)
            after = _tree_rss_mib(server.process.pid)
            print(
                f"server tree RSS MiB: before {before:.0f}, loaded {loaded:.0f}, after {after:.0f}"
            )
            assert "unloading model 'embedder' (no request for 1 s)" in server.log()
            assert after < before + 0.25 * (loaded - before)  # the core's memory is gone
            _embed(http, "embedder")  # loads again on its next request
    finally:
        server.stop()
