"""POST /v2/embed (Cohere Embed v2) through the official ``cohere`` SDK's ``ClientV2.embed``,
unmodified, against ``cenote serve`` on a tiny random sentence-transformers folder with
prompts: ``input_type`` picks the prompt as ``encode_query`` / ``encode_document`` do, every
``embedding_types`` entry is sentence-transformers' ``quantize_embeddings`` of the floats."""

from __future__ import annotations

import base64
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from factories.encoders import make_model
from factories.st_folders import save_sentence_transformer
from server_fixture import ServerProcess

ATOL = 1e-4  # DESIGN.md §3: embeddings vs sentence-transformers, fp32
MIN_COSINE_FP32 = 0.9999
PROMPTS = {"query": "query the : ", "passage": "mat : "}
CLUSTER_PROMPT = "cat cat : "
TEXTS = ["the cat sat", "a dog", "yes no yes", "the mat + the cat - a dog"]
TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trunk = tmp_path_factory.mktemp("trunk")
    make_model(trunk, "bert", seed=3)
    return save_sentence_transformer(
        trunk, tmp_path_factory.mktemp("st"), "mean", normalize=True, prompts=PROMPTS,
        max_seq_length=32,
    )  # fmt: skip


@pytest.fixture(scope="module")
def st_model(st_folder: Path):
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(2)
    return SentenceTransformer(str(st_folder), device="cpu").float().eval()


@pytest.fixture(scope="module")
def server(st_folder: Path):
    prompts = json.dumps({"clustering": CLUSTER_PROMPT})
    server = ServerProcess(
        str(st_folder), "--dtype", "float32", "--num-threads", "1",
        "--input-type-prompts", prompts,
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def co(server: ServerProcess):
    import cohere

    return cohere.ClientV2(api_key="unused", base_url=server.url)


@pytest.fixture(scope="module")
def model_name(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def _close(ours: list[list[float]], theirs: np.ndarray, label: str) -> np.ndarray:
    got = torch.tensor(ours)
    expected = torch.as_tensor(theirs).float()
    cos = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cos.min() >= MIN_COSINE_FP32, f"{label}: min cosine {cos.min():.6f}"
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=label)
    return got.numpy()


@pytest.mark.parametrize(
    ("input_type", "reference"),
    [
        ("search_query", lambda st: st.encode_query(TEXTS)),
        ("search_document", lambda st: st.encode_document(TEXTS)),  # "passage" here
        ("clustering", lambda st: st.encode(TEXTS, prompt=CLUSTER_PROMPT)),  # the server's flag
        ("classification", lambda st: st.encode(TEXTS)),  # no such prompt: the default (none)
    ],
)
def test_cohere_sdk_embed_every_type(co, model_name, st_model, input_type, reference) -> None:
    from sentence_transformers.util.quantization import quantize_embeddings

    response = co.embed(model=model_name, texts=TEXTS, input_type=input_type, embedding_types=TYPES)
    embeddings = response.embeddings
    floats = _close(embeddings.float_, reference(st_model), input_type)
    assert response.texts == TEXTS
    assert response.meta.billed_units.input_tokens >= len(TEXTS) * 3
    ranges = np.stack([np.full(floats.shape[1], -1.0), np.full(floats.shape[1], 1.0)])
    for kind in ("int8", "uint8", "binary", "ubinary"):
        expected = quantize_embeddings(floats, kind, ranges=ranges if "int" in kind else None)
        assert getattr(embeddings, kind) == expected.tolist(), kind
    decoded = [np.frombuffer(base64.b64decode(b), dtype="<f4") for b in embeddings.base64]
    assert np.array_equal(np.stack(decoded), floats)


def test_a_vector_does_not_depend_on_its_neighbours(co, model_name) -> None:
    """int8 / uint8 use fixed ranges: a text's vector is the same alone and in a batch."""
    together = co.embed(model=model_name, texts=TEXTS, input_type="search_document",
                        embedding_types=["int8", "uint8"]).embeddings  # fmt: skip
    alone = co.embed(model=model_name, texts=TEXTS[1:2], input_type="search_document",
                     embedding_types=["int8", "uint8"]).embeddings  # fmt: skip
    assert alone.int8 == together.int8[1:2] and alone.uint8 == together.uint8[1:2]


def test_truncate_and_dimensions(co, model_name, server: ServerProcess) -> None:
    import cohere

    long_text = " ".join(["cat", "dog"] * 40)  # > 32 tokens, the folder's max_seq_length
    end = co.embed(model=model_name, texts=[long_text], input_type="search_query")
    start = co.embed(model=model_name, texts=[long_text], input_type="search_query",
                     truncate="START")  # fmt: skip
    assert end.embeddings.float_ != start.embeddings.float_  # different halves were kept
    with pytest.raises(cohere.BadRequestError, match="max_model_len"):
        co.embed(model=model_name, texts=[long_text], input_type="search_query", truncate="NONE")
    cut = co.embed(model=model_name, texts=[long_text], input_type="search_query", max_tokens=8)
    assert cut.meta.billed_units.input_tokens == 8
    full = co.embed(model=model_name, texts=TEXTS[:1], input_type="search_query",
                    output_dimension=32)  # fmt: skip
    assert len(full.embeddings.float_[0]) == 32  # the model's size: accepted on any model
    with pytest.raises(cohere.BadRequestError, match="matryoshka"):
        co.embed(model=model_name, texts=TEXTS[:1], input_type="search_query", output_dimension=8)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_type": "search_query"}, "texts"),
        ({"input_type": "image", "texts": ["a"], "images": ["data:image/png;base64,AAAA"]},
         "pass exactly one of texts, images and inputs (got texts, images)"),
        ({"input_type": "image", "images": ["data:image/png;base64,AAAA"]},
         "is an image, but this model has no vision tower"),
        ({"input_type": "search_document", "inputs": [
            {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
        ]}, "no vision tower"),
        ({"input_type": "search_query", "texts": []}, "texts"),
        ({"input_type": "search_query", "texts": ["a"], "embedding_types": ["int4"]},
         "embedding_types"),
        ({"input_type": "query", "texts": ["a"]}, "input_type"),
        ({"input_type": "search_query", "texts": ["a"], "truncate": "MIDDLE"}, "truncate"),
        ({"texts": ["a"]}, "input_type"),
    ],
)  # fmt: skip
def test_bad_requests(server: ServerProcess, body: dict, message: str) -> None:
    response = httpx.post(f"{server.url}/v2/embed", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert message in response.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_bad_input_type_prompts_flag_exits_2(st_folder: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "cenote", "serve", str(st_folder),
         "--input-type-prompts", '{"search": "q: "}'],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 2
    assert "unknown input_type ['search']" in done.stderr and "Traceback" not in done.stderr
