"""text-embeddings-inference's routes through a real ``cenote serve``, with request bodies from
TEI's README and openapi.json: /embed, /embed_all, /similarity, /tokenize, /decode, /info on
the default model (MiniLM) against sentence-transformers; /predict and /rerank on tiny random
classifiers against transformers and sentence-transformers' CrossEncoder; Hugging Face's
``InferenceClient`` pointed at cenote unmodified; every bad body answered in TEI's error shape
with TEI's status and the numbers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from factories.encoders import make_encoder_classifier
from server_fixture import ServerProcess

COS = 0.9999  # DESIGN.md: embeddings vs sentence-transformers, fp32
ATOL = 1e-4  # DESIGN.md: classifier scores vs transformers, fp32
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
LONG_TEXT = "word " * 400  # 402 tokens with [CLS] and [SEP]; MiniLM's limit is 256
PAIR = ("the cat sat on the mat", "a cat sat")


@pytest.fixture(scope="module")
def minilm(default_server):
    with httpx.Client(base_url=default_server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def cross(cross_encoder_server):
    with httpx.Client(base_url=cross_encoder_server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("classifier")
    make_encoder_classifier(folder, "bert", "ForSequenceClassification", seed=3, num_labels=3,
                            id2label=LABELS, label2id={v: k for k, v in LABELS.items()})  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def classifier(classifier_dir: Path):
    server = ServerProcess(str(classifier_dir), "--dtype", "float32", "--num-threads", "1")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client
    finally:
        server.stop()


def _ok(response: httpx.Response):
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    return response.json()


def _tei_error(response: httpx.Response, status: int, error_type: str, *fragments: str) -> str:
    """TEI's error shape, status and type, and a message holding every fragment."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type, body
    for fragment in fragments:
        assert fragment in body["error"], body["error"]
    return body["error"]


def _cosines(got: list[list[float]], expected: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.tensor(got), expected.float(), dim=-1)


# ---- embedding model: MiniLM vs sentence-transformers --------------------------------------------


def test_embed_readme_body_and_batches_match_sentence_transformers(minilm, st_model) -> None:
    texts = ["What is Deep Learning?", "Deep learning is a subset of machine learning."]
    expected = st_model.encode(texts, convert_to_tensor=True)
    single = _ok(minilm.post("/embed", json={"inputs": "What is Deep Learning?"}))  # README
    assert len(single) == 1 and len(single[0]) == 384
    assert _cosines(single, expected[:1]).min() >= COS
    ids = st_model.tokenizer(texts[1])["input_ids"]
    batch = _ok(minilm.post("/embed", json={"inputs": [texts[0], ids], "truncate": False}))
    assert _cosines(batch, expected).min() >= COS  # a text and token ids in one batch
    assert np.linalg.norm(batch, axis=1) == pytest.approx([1.0, 1.0], abs=1e-5)
    raw = _ok(minilm.post("/embed", json={"inputs": texts, "normalize": False}))
    norms = np.linalg.norm(raw, axis=1)
    assert norms.min() > 1.5  # not normalized, and the same direction
    np.testing.assert_allclose(np.array(raw) / norms[:, None], batch, atol=1e-5)
    assert _ok(minilm.post("/embed", json={"inputs": texts[0], "dimensions": 384})) == single


def test_embed_truncates_when_asked_in_either_direction(minilm, st_model) -> None:
    error = _tei_error(minilm.post("/embed", json={"inputs": LONG_TEXT}), 422, "Validation")
    assert "402 tokens" in error and "256" in error
    right = _ok(minilm.post("/embed", json={"inputs": LONG_TEXT, "truncate": True}))
    expected = st_model.encode([LONG_TEXT], convert_to_tensor=True)  # cuts the end
    assert _cosines(right, expected).min() >= COS
    body = {"inputs": LONG_TEXT + "cat", "truncate": True, "truncation_direction": "Left"}
    left = _ok(minilm.post("/embed", json=body))
    words = st_model.tokenizer(LONG_TEXT + "cat", add_special_tokens=False)["input_ids"]
    kept = [101, *words[-254:], 102]  # the end of the text between [CLS] and [SEP]
    np.testing.assert_allclose(_ok(minilm.post("/embed", json={"inputs": kept})), left, atol=1e-6)
    assert _cosines(left, torch.tensor(right)).min() < COS  # the other end of the text


def test_embed_all_matches_sentence_transformers_token_embeddings(minilm, st_model) -> None:
    texts = ["What is Deep Learning?", "a cat"]
    got = _ok(minilm.post("/embed_all", json={"inputs": texts}))
    expected = st_model.encode(texts, output_value="token_embeddings")
    for tokens, reference in zip(got, expected, strict=True):
        assert np.array(tokens).shape == tuple(reference.shape)  # [num_tokens, 384]
        np.testing.assert_allclose(tokens, reference.numpy(), atol=ATOL)


def test_similarity_matches_sentence_transformers(minilm, st_model) -> None:
    from sentence_transformers.util import cos_sim

    source = "What is Deep Learning?"
    sentences = ["What is Machine Learning?", "Cats sleep most of the day.", "Deep learning!"]
    body = {"inputs": {"source_sentence": source, "sentences": sentences}}
    got = _ok(minilm.post("/similarity", json=body))
    embeddings = st_model.encode([source, *sentences], convert_to_tensor=True)
    expected = cos_sim(embeddings[:1], embeddings[1:])[0].tolist()
    assert got == pytest.approx(expected, abs=1e-5)
    body["parameters"] = {"truncate": True, "truncation_direction": "right"}
    assert _ok(minilm.post("/similarity", json=body)) == pytest.approx(got, abs=1e-6)


def test_tokenize_and_decode_in_tei_shape(minilm, st_model) -> None:
    tokens = _ok(minilm.post("/tokenize", json={"inputs": "héllo world"}))
    assert tokens == [[
        {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
        {"id": 7592, "text": "héllo", "special": False, "start": 0, "stop": 6},  # UTF-8 bytes
        {"id": 2088, "text": "world", "special": False, "start": 7, "stop": 12},
        {"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None},
    ]]  # fmt: skip
    texts = ["What is Deep Learning?", "a cat"]
    batch = _ok(minilm.post("/tokenize", json={"inputs": texts, "add_special_tokens": False}))
    expected = [st_model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert [[t["id"] for t in row] for row in batch] == expected
    assert [[t["text"] for t in row] for row in batch][1] == ["a", "cat"]
    vllm = _ok(minilm.post("/tokenize", json={"prompt": "a cat"}))  # the same path, vLLM's body
    assert vllm["tokens"] == [101, *expected[1], 102] and vllm["count"] == 4
    ids = [101, *expected[0], 102]
    assert _ok(minilm.post("/decode", json={"ids": ids})) == ["what is deep learning?"]
    decoded = _ok(minilm.post("/decode", json={"ids": [ids, [101, 2054]],
                                               "skip_special_tokens": False}))  # fmt: skip
    assert decoded == [st_model.tokenizer.decode(i) for i in (ids, [101, 2054])]
    assert _ok(minilm.post("/decode", json={"ids": []})) == [""]  # one empty list, as TEI


def test_info_describes_the_model_and_the_limits(minilm, default_server) -> None:
    info = _ok(minilm.get("/info"))
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["model_id"] == info["served_model_name"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert info["model_dtype"] == "float32"
    assert info["max_input_length"] == 256
    assert info["max_client_batch_size"] == 2048  # --max-inputs
    assert info["max_batch_tokens"] == 8192 and info["max_batch_requests"] == 256
    assert info["max_concurrent_requests"] == 256 + 4096  # running + --max-waiting-requests
    assert info["auto_truncate"] is False


def test_hugging_face_inference_client_unmodified(default_server, st_model, monkeypatch) -> None:
    """``InferenceClient(base_url)`` POSTs TEI's bodies to ``/``: feature_extraction and
    sentence_similarity as the hub client sends them."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    # the hub's offline switch (conftest) blocks every URL, this server's too
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    client = InferenceClient(base_url=default_server.url)
    text = "What is Deep Learning?"
    got = client.feature_extraction(text)
    expected = st_model.encode([text], convert_to_tensor=True)
    assert got.shape == (1, 384) and _cosines(got.tolist(), expected).min() >= COS
    got = client.feature_extraction(text, normalize=False, truncate=True)
    assert np.linalg.norm(got) > 1.5
    scores = client.sentence_similarity(text, other_sentences=["What is ML?", "Cats."])
    body = {"inputs": {"source_sentence": text, "sentences": ["What is ML?", "Cats."]}}
    assert scores == pytest.approx(_ok(httpx.post(f"{default_server.url}/similarity", json=body)))


# ---- classifiers: /predict and TEI's /rerank -----------------------------------------------------


def _logits(folder: Path, inputs: list[str | tuple[str, str]]) -> torch.Tensor:
    """transformers' logits of texts and pairs: [num_inputs, num_labels]."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).float().eval()
    rows = []
    with torch.no_grad():
        for item in inputs:
            encoded = tokenizer(*((item,) if isinstance(item, str) else item), return_tensors="pt")
            rows.append(model(**encoded).logits[0])
    return torch.stack(rows)


def _check_predictions(got: list[dict], scores: torch.Tensor) -> None:
    """Every label once, best first, each score its label's."""
    assert [p["score"] for p in got] == sorted((p["score"] for p in got), reverse=True)
    assert sorted(p["label"] for p in got) == sorted(LABELS.values())
    names = {name: i for i, name in LABELS.items()}
    for prediction in got:
        assert prediction["score"] == pytest.approx(float(scores[names[prediction["label"]]]),
                                                    abs=ATOL)  # fmt: skip


def test_predict_text_pair_and_batch_match_transformers(classifier, classifier_dir) -> None:
    logits = _logits(classifier_dir, ["I like you.", PAIR])
    probs = logits.softmax(-1)
    single = _ok(classifier.post("/predict", json={"inputs": "I like you."}))  # README
    _check_predictions(single, probs[0])
    pair = _ok(classifier.post("/predict", json={"inputs": list(PAIR)}))
    _check_predictions(pair, probs[1])
    body = {"inputs": [["I like you."], list(PAIR)], "raw_scores": True}
    batch = _ok(classifier.post("/predict", json=body))
    assert len(batch) == 2
    for predictions, row in zip(batch, logits, strict=True):
        _check_predictions(predictions, row)
    assert _ok(classifier.post("/", json={"inputs": "I like you."})) == single  # TEI's POST /
    info = _ok(classifier.get("/info"))
    assert info["model_type"] == {"classifier": {"id2label": {str(k): v for k, v in LABELS.items()},
                                                 "label2id": {v: k for k, v in LABELS.items()}}}  # fmt: skip


def test_rerank_readme_body_matches_cross_encoder(cross, cross_encoder_dir) -> None:
    from sentence_transformers import CrossEncoder

    query, texts = "What is Deep Learning?", ["Deep Learning is not...", "Deep learning is..."]
    model = CrossEncoder(str(cross_encoder_dir), device="cpu")
    expected = model.predict([(query, t) for t in texts])  # sigmoid of the logit
    ranks = _ok(cross.post("/rerank", json={"query": query, "texts": texts}))  # README
    assert [r["index"] for r in ranks] == list(np.argsort(-expected, kind="stable"))
    for rank in ranks:
        assert set(rank) == {"index", "score"}
        assert rank["score"] == pytest.approx(float(expected[rank["index"]]), abs=ATOL)
    body = {"query": query, "texts": texts, "raw_scores": True, "return_text": True}
    raw = _ok(cross.post("/rerank", json=body))
    logits = _logits(cross_encoder_dir, [(query, t) for t in texts])[:, 0]
    for rank in raw:
        assert rank["text"] == texts[rank["index"]]
        assert rank["score"] == pytest.approx(float(logits[rank["index"]]), abs=ATOL)
    assert _ok(cross.post("/", json={"query": query, "texts": texts})) == ranks  # TEI's POST /
    predicted = _ok(cross.post("/predict", json={"inputs": [query, texts[0]]}))
    assert predicted == [{"score": pytest.approx(float(expected[0]), abs=ATOL), "label": "LABEL_0"}]
    info = _ok(cross.get("/info"))
    assert info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"},
                                               "label2id": {"LABEL_0": 0}}}  # fmt: skip


def test_rerank_truncate_fits_long_texts(cross) -> None:
    long_text = " ".join(["w40"] * 200)  # past the tiny model's 128 positions
    body = {"query": "the cat", "texts": ["a cat sat", long_text]}
    _tei_error(cross.post("/rerank", json=body), 422, "Validation", "pair 1 has", "128")
    ranks = _ok(cross.post("/rerank", json={**body, "truncate": True}))
    assert sorted(r["index"] for r in ranks) == [0, 1]


def test_rerank_with_an_empty_query_is_refused(cross) -> None:
    body = {"query": "", "texts": ["a cat sat"]}
    _tei_error(cross.post("/rerank", json=body), 422, "Validation", "query is empty")
    assert _ok(cross.post("/rerank", json={**body, "query": "the cat"}))


def test_rerank_on_an_embedding_model_scores_by_cosine(minilm, st_model) -> None:
    from sentence_transformers.util import cos_sim

    query, texts = "How do cats sleep?", ["Paris is in France.", "Cats sleep all day."]
    ranks = _ok(minilm.post("/rerank", json={"query": query, "texts": texts}))
    embeddings = st_model.encode([query, *texts], convert_to_tensor=True)
    expected = cos_sim(embeddings[:1], embeddings[1:])[0]
    assert [r["index"] for r in ranks] == [1, 0]
    assert [r["score"] for r in ranks] == pytest.approx(expected[[1, 0]].tolist(), abs=1e-5)


# ---- bad input: TEI's error shapes and statuses ---------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "error_type", "fragments"),
    [
        ("/embed", {"inputs": []}, 400, "Empty", ["`inputs` cannot be empty"]),
        ("/embed_all", {"inputs": []}, 400, "Empty", ["`inputs` cannot be empty"]),
        ("/tokenize", {"inputs": []}, 400, "Empty", ["`inputs` cannot be empty"]),
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 400, "Empty",
         ["`inputs.sentences` cannot be empty"]),
        ("/rerank", {"query": "a", "texts": []}, 400, "Empty", ["`texts` cannot be empty"]),
        ("/embed", {"inputs": ["a"] * 2049}, 422, "Validation", ["got 2049 inputs", "2048"]),
        ("/embed", {"inputs": 5}, 422, "Validation", ["inputs: got 5"]),
        ("/embed", {"inputs": [["a", "b"]]}, 422, "Validation", ["inputs"]),  # a pair
        ("/embed", {"inputs": "a", "normalize": "yes"}, 422, "Validation", ["normalize"]),
        ("/embed", {"inputs": "a", "dimensions": 0}, 422, "Validation", ["dimensions", "0"]),
        ("/embed", {"inputs": "a", "dimensions": 100}, 422, "Validation", ["384"]),
        ("/embed", {"inputs": "a", "prompt_name": "query"}, 422, "Validation",
         ["prompt_name 'query'"]),
        ("/embed", {"inputs": ["a", ""]}, 422, "Validation", ["inputs[1] is an empty string"]),
        ("/embed", {"inputs": "a", "top_k": 3}, 422, "Validation", ["unknown field 'top_k'"]),
        ("/decode", {"ids": [1, 40000]}, 422, "Validation", ["[40000]", "30522"]),
        ("/tokenize", {"inputs": ["a"] * 2049}, 422, "Validation", ["got 2049 texts", "2048"]),
        ("/predict", {"inputs": "I like you."}, 424, "Backend",
         ["/predict needs a classifier", "embed, token_embed"]),
        ("/predict", {"inputs": ["a", "b"]}, 424, "Backend", ["needs a classifier"]),  # a pair
    ],
)  # fmt: skip
def test_bad_input_on_the_embedding_model(minilm, path, body, status, error_type, fragments):
    _tei_error(minilm.post(path, json=body), status, error_type, *fragments)


def test_bad_input_on_classifiers(classifier, cross) -> None:
    _tei_error(classifier.post("/predict", json={"inputs": ["a", "b", "c"]}), 422, "Validation",
               "inputs has 3 texts")  # fmt: skip
    _tei_error(classifier.post("/predict", json={"inputs": [["a"], ["a", "b", "c"]]}), 422,
               "Validation", "inputs[1] has 3 texts")  # fmt: skip
    _tei_error(classifier.post("/predict", json={"inputs": []}), 400, "Empty")
    _tei_error(classifier.post("/rerank", json={"query": "a", "texts": ["b"]}), 424, "Backend",
               "a classifier with 1 label", "3 labels")  # fmt: skip
    _tei_error(cross.post("/embed", json={"inputs": "a"}), 424, "Backend",
               "/embed needs an embedding model", "serves classify")  # fmt: skip
    for path in ("/embed_all", "/similarity"):
        body = {"inputs": {"source_sentence": "a", "sentences": ["b"]}} if "sim" in path else {
            "inputs": "a"}  # fmt: skip
        _tei_error(cross.post(path, json=body), 424, "Backend", "serves classify")


def test_shared_paths_keep_their_other_api(minilm) -> None:
    """A Jina or vLLM body on /rerank and /tokenize is answered and refused in OpenAI's shape;
    the front door refuses a body on TEI's routes in TEI's shape, on the others in OpenAI's."""
    jina = _ok(minilm.post("/rerank", json={"query": "a", "documents": ["b"]}))
    assert jina["results"][0]["index"] == 0
    error = minilm.post("/rerank", json={"query": "a"}).json()["error"]
    assert error["code"] == 400 and "documents" in error["message"]
    error = minilm.post("/tokenize", json={"prompt": 5}).json()["error"]
    assert error["code"] == 400 and "prompt" in error["message"]
    json_headers = {"content-type": "application/json"}
    not_json = minilm.post("/embed", content=b"{", headers=json_headers)
    _tei_error(not_json, 400, "Validation", "not valid JSON")
    too_large = minilm.post("/embed", content=b" " * ((16 << 20) + 1), headers=json_headers)
    _tei_error(too_large, 413, "Validation", f"{(16 << 20) + 1} bytes", str(16 << 20))
    too_large = minilm.post("/v1/embeddings", content=b" " * ((16 << 20) + 1), headers=json_headers)
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == 413
