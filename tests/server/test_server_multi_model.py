"""One ``cenote serve`` with several models (``--model NAME=PATH`` and ``--config``): each route
answers by the body's ``model`` as the offline engine does for that model; an unknown name is
a 404 listing the served ones; a model whose weights do not load answers 503 naming it while
the others serve; each engine core runs with the CPU share the policy gives it."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
import torch

from cenote.engine.cpu_shares import plan_cpu_shares
from tests.factories.decoders import make_decoder
from tests.factories.generation import hf_greedy, random_prompts
from tests.factories.lora import write_adapter
from tests.server_fixture import ServerProcess

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }} {{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}{% endif %}"
)
NAMES = ["embedder", "reranker", "chat", "broken"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_path, cross_encoder_dir):
    root = tmp_path_factory.mktemp("multi_model")
    chat = make_decoder(root / "chat", "llama", seed=5)
    sql = write_adapter(chat, root / "sql", 1, ["q_proj", "v_proj"], r=4, lora_alpha=8)
    broken = root / "broken"  # config and tokenizer read fine; the weights are not safetensors
    shutil.copytree(cross_encoder_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    return {"embedder": minilm_path, "reranker": cross_encoder_dir, "chat": root / "chat",
            "broken": broken, "root": root, "sql": sql}  # fmt: skip


@pytest.fixture(scope="module")
def server(folders):
    """Two models on the command line, two from a config file (the chat model's template and
    its own token budget only there); no --num-threads: the CPU policy decides."""
    config = folders["root"] / "models.json"
    config.write_text(json.dumps({"models": {
        "chat": {"model": "chat", "chat_template": CHAT_TEMPLATE, "max_num_batched_tokens": 512,
                 "lora_modules": [f"sql={folders['root'] / 'sql'}"]},
        "broken": {"model": str(folders["broken"])},
    }}))  # fmt: skip
    process = ServerProcess(
        "--model", f"embedder={folders['embedder']}", "--model",
        f"reranker={folders['reranker']}", "--config", str(config), "--dtype", "float32",
        timeout_s=240,  # four engines starting at once on this 2-core box
    )  # fmt: skip
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_models_lists_every_model_with_its_tasks(http):
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert list(cards) == ["embedder", "reranker", "chat", "sql", "broken"]  # adapter after base
    assert cards["sql"]["parent"] == "chat"
    assert "embed" in cards["embedder"]["supported_tasks"]
    assert "classify" in cards["reranker"]["supported_tasks"]
    assert "generate" in cards["chat"]["supported_tasks"]
    assert cards["broken"]["supported_tasks"] == []
    assert http.get("/v1/models/reranker").json()["id"] == "reranker"


def test_each_engine_core_runs_with_its_cpu_share(http):
    """Three live cores of one replica each (the broken one never reports): disjoint CPU sets
    when the machine has two CPUs a core, else every CPU shared, threads summing to them."""
    available = sorted(os.sched_getaffinity(0))
    expected = plan_cpu_shares([1, 1, 1, 1], available)
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    for name, share in zip(NAMES, expected, strict=True):
        cores = cards[name]["engine_cores"]
        if name == "broken":
            assert cores == []
            continue
        cpu_ids = list(share.cpu_ids) if share.cpu_ids is not None else available
        assert cores == [{"num_threads": share.num_threads, "cpu_ids": cpu_ids}]
    if len(available) < 8:  # this CI box (2 CPUs): one shared set, one thread a core
        assert all(s.cpu_ids is None and s.num_threads == 1 for s in expected)


def test_embeddings_equal_the_offline_engine(http, folders, llm_fp32):
    texts = ["a cat sat on the mat", "quantum chromodynamics"]
    response = http.post("/v1/embeddings", json={"model": "embedder", "input": texts})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "embedder"
    got = torch.tensor([row["embedding"] for row in response.json()["data"]])
    expected = torch.stack([out.outputs.data for out in llm_fp32.embed(texts)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # no model named: the first model that embeds (the embedder), as TEI's /embed
    default = http.post("/v1/embeddings", json={"input": texts})
    assert default.json()["model"] == "embedder"
    tei = torch.tensor(http.post("/embed", json={"inputs": texts}).json())
    torch.testing.assert_close(tei, expected, atol=1e-5, rtol=0)


def test_rerank_equals_the_offline_engine(http, folders):
    from cenote import LLM

    query, documents = "w5 w6", ["w7 w8 w9", "w5", "w10 w11"]
    llm = LLM(str(folders["reranker"]), dtype="float32", num_threads=1)
    expected = [out.outputs.score for out in llm.score(query, documents, use_tqdm=False)]
    body = {"model": "reranker", "query": query, "documents": documents}
    response = http.post("/v1/rerank", json=body)
    assert response.status_code == 200, response.text
    got = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
    assert got == pytest.approx(dict(enumerate(expected)), abs=1e-5)
    # TEI's /rerank names no model: the cross-encoder, not the embedder listed first
    tei = http.post("/rerank", json={"query": query, "texts": documents}).json()
    assert {r["index"]: r["score"] for r in tei} == pytest.approx(got, abs=1e-5)


def test_chat_and_completions_equal_the_offline_engine(http, folders):
    from cenote import LLM, SamplingParams

    llm = LLM(str(folders["chat"]), dtype="float32", num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=6)
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    expected_chat = llm.chat(messages, params, chat_template=CHAT_TEMPLATE, use_tqdm=False)
    expected_text = llm.generate(["w9 w10"], params, use_tqdm=False)
    chat = http.post(
        "/v1/chat/completions",
        json={"model": "chat", "messages": messages, "max_tokens": 6, "temperature": 0},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == expected_chat[0].outputs[0].text
    # no model named: the first model that generates
    completion = http.post(
        "/v1/completions", json={"prompt": "w9 w10", "max_tokens": 6, "temperature": 0}
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == "chat"
    assert completion.json()["choices"][0]["text"] == expected_text[0].outputs[0].text


def test_an_adapter_name_goes_to_its_base_model(http, folders):
    """A LoRA adapter of the chat model (from the config file) is asked for by its own name
    and answers as peft's merged model; ``/v1/models/sql`` is its card."""
    prompt = random_prompts([7], seed=3)[0]
    body = {"model": "sql", "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "sql"
    assert response.json()["choices"][0]["token_ids"] == hf_greedy(folders["sql"], [prompt], 6)[0]
    assert http.get("/v1/models/sql").json()["parent"] == "chat"


def test_unknown_model_is_404_listing_the_served_ones(http):
    for path, body in [
        ("/v1/embeddings", {"model": "nope", "input": "a"}),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "a"}]}),
        ("/v1/rerank", {"model": "nope", "query": "a", "documents": ["b"]}),
        ("/tokenize", {"model": "nope", "prompt": "a"}),
    ]:
        response = http.post(path, json=body)
        assert response.status_code == 404, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "not_found_error" and error["param"] == "model"
        assert error["message"] == (
            "the model 'nope' does not exist; this server serves 'embedder', 'reranker', "
            "'chat', 'sql', 'broken'"
        )
    assert http.get("/v1/models/nope").status_code == 404


def test_a_model_that_failed_to_load_is_503_naming_it_and_the_others_serve(http):
    response = http.post("/v1/rerank", json={"model": "broken", "query": "a", "documents": ["b"]})
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("the model 'broken' is not available: the engine core failed")
    health = http.get("/health")
    assert health.status_code == 200
    models = health.json()["models"]
    assert health.json()["status"] == "degraded"
    assert {name: entry["status"] for name, entry in models.items()} == {
        "embedder": "ok", "reranker": "ok", "chat": "ok", "broken": "dead",
    }  # fmt: skip
    assert "failed to start" in models["broken"]["reason"]
    assert http.post("/v1/embeddings", json={"model": "embedder", "input": "a"}).status_code == 200


def test_metrics_label_each_series_by_model(http):
    http.post("/v1/embeddings", json={"model": "embedder", "input": "metrics"})
    text = http.get("/metrics").text
    for name in ("embedder", "reranker", "chat"):
        assert f'cenote_prompt_tokens_total{{model_name="{name}"}}' in text
    assert text.count("# TYPE cenote_prompt_tokens_total counter") == 1  # one family


def test_a_mixed_load_across_the_models_answers_as_the_offline_engines(server, folders, llm_fp32):
    """Embeddings, reranks and chats sent at once from 6 clients (36 requests, interleaved):
    every answer equals its model's offline engine, none is a 5xx."""
    from concurrent.futures import ThreadPoolExecutor

    from cenote import LLM, SamplingParams

    reranker = LLM(str(folders["reranker"]), dtype="float32", num_threads=1)
    chat = LLM(str(folders["chat"]), dtype="float32", num_threads=1)
    greedy = SamplingParams(temperature=0, max_tokens=5)
    work = []
    for i in range(12):
        texts = [f"load text {i}", f"w{i + 5} w{i + 6}"]
        embedded = [out.outputs.data for out in llm_fp32.embed(texts, use_tqdm=False)]
        work.append(("/v1/embeddings", {"model": "embedder", "input": texts}, embedded))
        query, documents = f"w{i + 5}", [f"w{i + 6} w{i + 7}", f"w{i + 5}"]
        scores = [o.outputs.score for o in reranker.score(query, documents, use_tqdm=False)]
        body = {"model": "reranker", "query": query, "documents": documents}
        work.append(("/v1/rerank", body, scores))
        prompt = f"w{i + 8} w{i + 9} w{i + 10}"
        text = chat.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
        body = {"model": "chat", "prompt": prompt, "max_tokens": 5, "temperature": 0}
        work.append(("/v1/completions", body, text))

    def send(item):
        path, body, expected = item
        with httpx.Client(base_url=server.url, timeout=120) as client:
            return path, client.post(path, json=body), expected

    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(send, work))
    for path, response, expected in answers:
        assert response.status_code == 200, (path, response.status_code, response.text)
        body = response.json()
        if path == "/v1/embeddings":
            got = torch.tensor([row["embedding"] for row in body["data"]])
            torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=0)
        elif path == "/v1/rerank":
            got = {r["index"]: r["relevance_score"] for r in body["results"]}
            assert got == pytest.approx(dict(enumerate(expected)), abs=1e-5)
        else:
            assert body["choices"][0]["text"] == expected
