"""/classify, /score, /rerank (Jina), /v2/rerank (Cohere) through a real ``cenote serve``:
results equal the offline ``LLM.score`` / ``LLM.classify`` on the same model, for a tiny
cross-encoder and for the default embedding model (bi-encoder cosine); bad input answers 400."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import httpx
import pytest

from cenote import LLM

ATOL = 1e-5
QUERY = "the cat sat on the mat"
DOCUMENTS = ["a cat sat", "dog", "the mat w40 w41 w42 w43 yes no", "query document", "yes"]
MINILM_QUERY = "How do cats sleep?"
MINILM_DOCUMENTS = [
    "Paris is the capital of France.",
    "Cats sleep most of the day, often curled up.",
    "Dogs like to play fetch.",
]


@pytest.fixture(scope="module")
def cross_llm(cross_encoder_dir: Path) -> LLM:
    return LLM(str(cross_encoder_dir), dtype="float32", num_threads=1)


@pytest.fixture(scope="module")
def cross(cross_encoder_server):
    """The session's tiny cross-encoder server (conftest), shared with other modules."""
    with httpx.Client(base_url=cross_encoder_server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def minilm(default_server):
    """The session's default-model server (conftest), shared with other modules."""
    with httpx.Client(base_url=default_server.url, timeout=60) as client:
        yield client


def _offline_scores(llm: LLM, text_1, text_2, **kwargs) -> list[float]:
    return [o.outputs.score for o in llm.score(text_1, text_2, use_tqdm=False, **kwargs)]


def _post(client: httpx.Client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _check_ranking(results: list[dict], expected: list[float], documents: list[str] | None):
    """Best first, ties by index; each score equals the offline score of its document."""
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=ATOL)
        if documents is None:
            assert "document" not in result
        else:
            assert result["document"] == {"text": documents[result["index"]]}


def test_rerank_jina_matches_offline(cross, cross_llm) -> None:
    expected = _offline_scores(cross_llm, QUERY, DOCUMENTS)
    documents = [d if i % 2 else {"text": d} for i, d in enumerate(DOCUMENTS)]  # both forms
    body = _post(cross, "/rerank", {"query": QUERY, "documents": documents})
    assert len(body["results"]) == len(DOCUMENTS)
    assert sorted(r["index"] for r in body["results"]) == list(range(len(DOCUMENTS)))
    _check_ranking(body["results"], expected, DOCUMENTS)
    num_tokens = sum(len(o.prompt_token_ids) for o in cross_llm.score(QUERY, DOCUMENTS))
    assert body["usage"]["total_tokens"] == num_tokens
    top = _post(
        cross,
        "/v1/rerank",
        {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False},
    )
    _check_ranking(top["results"], expected, None)
    assert [r["index"] for r in top["results"]] == [r["index"] for r in body["results"][:2]]


def test_rerank_cohere_v2_matches_offline(cross, cross_llm) -> None:
    expected = _offline_scores(cross_llm, QUERY, DOCUMENTS)
    body = _post(cross, "/v2/rerank", {"query": QUERY, "documents": DOCUMENTS})
    _check_ranking(body["results"], expected, None)  # Cohere returns no documents by default
    assert len(body["results"]) == len(DOCUMENTS) and "meta" in body
    best_first = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    assert [r["index"] for r in body["results"]] == best_first
    top = _post(
        cross,
        "/v2/rerank",
        {"query": QUERY, "documents": DOCUMENTS, "top_n": 3, "return_documents": True},
    )
    assert [r["index"] for r in top["results"]] == best_first[:3]
    _check_ranking(top["results"], expected, DOCUMENTS)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_shapes_match_offline(cross, cross_llm, path) -> None:
    cases = [
        ("dog", "a cat sat"),  # 1 -> 1
        (QUERY, DOCUMENTS),  # 1 -> N
        ([QUERY, "dog", "yes"], ["a cat sat", "yes", "the mat"]),  # N -> N
    ]
    for text_1, text_2 in cases:
        body = _post(cross, path, {"text_1": text_1, "text_2": text_2})
        expected = _offline_scores(cross_llm, text_1, text_2)
        assert [d["index"] for d in body["data"]] == list(range(len(expected)))
        got = [d["score"] for d in body["data"]]
        assert got == pytest.approx(expected, abs=ATOL)
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0


def test_score_options_match_offline(cross, cross_llm) -> None:
    long_document = "the mat w40 w41 w42 w43 w44 w45 w46 w47"
    for options in ({"max_tokens_per_doc": 3}, {"truncate_prompt_tokens": 10}):
        body = _post(
            cross,
            "/score",
            {"text_1": QUERY, "text_2": [long_document, "dog"], "priority": 1, **options},
        )
        expected = _offline_scores(cross_llm, QUERY, [long_document, "dog"], **options)
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=ATOL)
    body = _post(cross, "/score", {"text_1": "a", "text_2": "b", "request_id": "my-score"})
    assert body["id"] == "my-score"


def test_classify_matches_offline(cross, cross_llm) -> None:
    for input_ in ("the cat sat", DOCUMENTS):
        body = _post(cross, "/classify", {"input": input_})
        expected = cross_llm.classify(input_, use_tqdm=False)
        assert len(body["data"]) == len(expected)
        for i, (item, out) in enumerate(zip(body["data"], expected, strict=True)):
            assert item["index"] == i and item["num_classes"] == 1
            assert item["label"] == out.outputs.label
            assert item["probs"] == pytest.approx(out.outputs.probs, abs=ATOL)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "2 queries and 3 documents"),
        ("/score", {"text_1": "a", "text_2": []}, "at least one text in text_2"),
        ("/rerank", {"query": "a", "documents": []}, "at least one document, got 0"),
        ("/v2/rerank", {"query": "a", "documents": []}, "at least one document, got 0"),
        ("/rerank", {"query": "", "documents": ["b"]}, "query is empty (0 characters"),
        ("/v2/rerank", {"query": "  ", "documents": ["b"]}, "query is empty (2 characters"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("/score", {"text_1": "cat dog", "text_2": "yes", "truncate_prompt_tokens": 4},
         "the query has 2 tokens"),
        ("/score", {"text_1": "a", "text_2": "b", "max_tokens_per_doc": -1}, "greater than or equal to 0"),
        ("/score", {"text_1": "a", "text_2": "b", "model": "nope"}, "does not exist"),
    ],
)  # fmt: skip
def test_bad_scoring_input_is_400(cross, path, body, message) -> None:
    response = cross.post(path, json=body)
    expected_status = 404 if "model" in body else 400
    assert response.status_code == expected_status, response.text
    assert message in response.json()["error"]["message"]


def test_embedding_model_scores_by_cosine(minilm, llm_fp32) -> None:
    expected = _offline_scores(llm_fp32, MINILM_QUERY, MINILM_DOCUMENTS)
    body = _post(minilm, "/rerank", {"query": MINILM_QUERY, "documents": MINILM_DOCUMENTS})
    _check_ranking(body["results"], expected, MINILM_DOCUMENTS)
    assert body["results"][0]["index"] == 1  # the cat sentence
    body = _post(minilm, "/v2/rerank", {"query": MINILM_QUERY, "documents": MINILM_DOCUMENTS})
    _check_ranking(body["results"], expected, None)
    queries = [MINILM_QUERY, "What is the capital of France?", "Tell me about dogs."]
    body = _post(minilm, "/v1/score", {"text_1": queries, "text_2": MINILM_DOCUMENTS})
    expected = _offline_scores(llm_fp32, queries, MINILM_DOCUMENTS)
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=ATOL)


def test_embedding_model_rejects_classify(minilm) -> None:
    response = minilm.post("/classify", json={"input": "a cat"})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "'classify' is not supported" in message and "it supports embed, token_embed" in message


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_rerank_chunk_and_max_matches_offline(cross, cross_llm, minilm, path) -> None:
    """``rerank_chunking: "max"``: a long document scores as its best window (offline
    ``LLM.score(rerank_chunking="max")``, checked against CrossEncoder in test_score.py), and
    the result names that window; embedding models refuse it, chunk_overlap alone is a 400."""
    limit = cross_llm.config.model.max_model_len
    long_document = " ".join(f"w{40 + i % 20}" for i in range(2 * limit))
    documents = [long_document, *DOCUMENTS]
    offline = cross_llm.score(QUERY, documents, rerank_chunking="max", chunk_overlap=2)
    body = _post(cross, path, {"query": QUERY, "documents": documents,
                               "rerank_chunking": "max", "chunk_overlap": 2})  # fmt: skip
    _check_ranking(body["results"], [o.outputs.score for o in offline], None if "v2" in path
                   else documents)  # fmt: skip
    by_index = {r["index"]: r for r in body["results"]}
    assert by_index[0]["chunk_index"] == offline[0].outputs.chunk_index
    assert body["usage"]["total_tokens"] == sum(len(o.prompt_token_ids) for o in offline)
    refused = minilm.post(path, json={"query": "a", "documents": ["b"], "rerank_chunking": "max"})
    assert refused.status_code == 400 and "applies to cross-encoders" in refused.text
    alone = cross.post(path, json={"query": "a", "documents": ["b"], "chunk_overlap": 2})
    assert alone.status_code == 400 and "rerank_chunking 'max'" in alone.text
