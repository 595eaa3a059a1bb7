"""Sparse (SPLADE) embeddings through ``cenote serve``: TEI's ``/embed_sparse``, ``/pooling``
with ``task: embed_sparse`` and ``/v1/embeddings`` with ``sparse: true``, equal to the offline
``LLM.embed_sparse``."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import httpx
import pytest
import torch
from factories.encoders import make_model
from factories.st_folders import save_sparse_encoder
from server_fixture import ServerProcess

from cenote import LLM

ATOL = 1e-5  # the same engine in both processes, fp32
TEXTS = ["the cat sat", "a dog", "yes no yes w40 w41", "the mat + the cat - a dog"]


@pytest.fixture(scope="module")
def splade_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = tmp_path_factory.mktemp("raw")
    make_model(raw, "distilbert", "ForMaskedLM", seed=4)
    return save_sparse_encoder(raw, tmp_path_factory.mktemp("splade"))


@pytest.fixture(scope="module")
def offline(splade_dir: Path) -> torch.Tensor:
    llm = LLM(str(splade_dir), dtype="float32", num_threads=1)
    return torch.stack([out.outputs.data for out in llm.embed_sparse(TEXTS)])


@pytest.fixture(scope="module")
def client(splade_dir: Path):
    server = ServerProcess(
        str(splade_dir), "--dtype", "float32", "--num-threads", "1", "--max-response-values", "600"
    )
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client
    finally:
        server.stop()


def test_embed_sparse_tei_shape(client: httpx.Client, offline: torch.Tensor) -> None:
    response = client.post("/embed_sparse", json={"inputs": TEXTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body) == len(TEXTS)
    for entries, expected in zip(body, offline, strict=True):
        ids = [e["index"] for e in entries]
        assert ids == sorted(ids) == expected.nonzero().flatten().tolist()
        got = torch.tensor([e["value"] for e in entries])
        torch.testing.assert_close(got, expected[ids], atol=ATOL, rtol=0)
    single = client.post("/embed_sparse", json={"inputs": TEXTS[1]}).json()
    assert single == [body[1]]
    assert client.post("/", json={"inputs": TEXTS}).json() == body  # TEI's POST / on SPLADE
    assert client.get("/info").json()["model_type"] == {"embedding": {"pooling": "splade"}}


def test_pooling_route_gives_the_vocabulary_vector(client: httpx.Client, offline) -> None:
    response = client.post("/pooling", json={"input": TEXTS, "task": "embed_sparse"})
    assert response.status_code == 200, response.text
    data = torch.tensor([item["data"] for item in response.json()["data"]])
    torch.testing.assert_close(data, offline, atol=ATOL, rtol=0)


def test_openai_embeddings_with_sparse_extension(client: httpx.Client, offline) -> None:
    response = client.post("/v1/embeddings", json={"input": TEXTS, "sparse": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
    for item, expected in zip(body["data"], offline, strict=True):
        embedding = item["embedding"]
        assert embedding["indices"] == expected.nonzero().flatten().tolist()
        got = torch.tensor(embedding["values"])
        torch.testing.assert_close(got, expected[embedding["indices"]], atol=ATOL, rtol=0)
    base64 = {"input": "a dog", "sparse": True, "encoding_format": "base64"}
    refused = client.post("/v1/embeddings", json=base64)
    assert refused.status_code == 400 and "encoding_format" in refused.text


def test_bad_requests(client: httpx.Client) -> None:
    long_text = " ".join(["cat"] * 400)
    too_long = client.post("/embed_sparse", json={"inputs": long_text})
    assert too_long.status_code == 400 and "max_model_len" in too_long.text
    cut = client.post("/embed_sparse", json={"inputs": long_text, "truncate": True})
    assert cut.status_code == 200, cut.text
    unknown = client.post("/embed_sparse", json={"inputs": "a", "prompt_name": "q"})
    assert unknown.status_code == 400 and "prompt_name 'q' is not one of" in unknown.text
    assert client.post("/embed_sparse", json={"inputs": "a", "top": 3}).status_code == 400
    dense = client.post("/v1/embeddings", json={"input": "a dog"})
    assert dense.status_code == 400 and "embed_sparse" in dense.text
    # a vocabulary-sized vector per input (128 here): 5 inputs exceed --max-response-values 600
    many = client.post("/pooling", json={"input": TEXTS + ["a"], "task": "embed_sparse"})
    assert many.status_code == 400 and "--max-response-values" in many.text
    assert client.get("/health").status_code == 200  # the engine survived all of it
