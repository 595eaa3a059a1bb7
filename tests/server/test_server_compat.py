"""Exact OpenAI / vLLM / Cohere behaviour of ``cenote serve`` (issue 8, items 4 and 6): request
bodies read strictly, errors typed as OpenAI documents them, the OpenAPI schema as the contract,
and the vLLM fields cenote implements. One server per model: the default all-MiniLM-L6-v2 and
the SmolLM2 GGUF."""

from __future__ import annotations

import base64
import json
import os

import httpx
import numpy as np
import pytest
import torch

from cenote.server.routes_tei import TEI_PATHS
from tests.factories.generation import smollm2_path
from tests.server_fixture import ServerProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
LONG_TEXT = "word " * 300  # > 256 tokens, MiniLM's limit
BODY_LIMIT = 200_000
SMOL_LEN = 160  # max_model_len of the SmolLM2 server: chat's default max_tokens is the rest


@pytest.fixture(scope="module")
def minilm():
    server = ServerProcess(
        "--dtype", "float32", "--num-threads", "1", "--auto-truncate",
        "--max-body-bytes", str(BODY_LIMIT),
        "--hf-overrides", json.dumps({"matryoshka_dimensions": [384, 128, 64]}),
    )  # fmt: skip
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def smol():
    path = smollm2_path()
    server = ServerProcess(
        str(path), "--dtype", "float32", "--num-threads", "1", "--max-model-len", str(SMOL_LEN),
        "--max-num-seqs", "2", "--max-waiting-requests", "2",
    )  # fmt: skip
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            client.name = path.name  # type: ignore[attr-defined]
            yield client
    finally:
        server.stop()


def _error(response: httpx.Response, status: int, *phrases: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    for phrase in phrases:
        assert phrase in error["message"], error["message"]
    return error


# ---- bodies read strictly: 400 invalid_request_error with the reason ---------------------------


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        (b'{"input": "a",', "not valid JSON"),
        (b'{"input": "caf\xe9"}', "not valid UTF-8"),
        (b"[" * 200 + b"]" * 200, "nests deeper than 64"),
        (b'{"input": "\\ud800 x"}', "lone surrogate"),
        (b'{"input": "a", "dimensions": NaN}', "NaN"),
    ],
)
def test_unreadable_bodies_are_400_invalid_request(minilm, content, phrase) -> None:
    headers = {"Content-Type": "application/json"}
    response = minilm.post("/v1/embeddings", content=content, headers=headers)
    error = _error(response, 400, phrase)
    assert error["type"] == "invalid_request_error" and error["param"] is None


def test_chunked_body_over_the_limit_is_413(minilm) -> None:
    def chunks():
        yield b'{"input": "'
        for _ in range(BODY_LIMIT // 10_000 + 2):
            yield b"a" * 10_000
        yield b'"}'

    headers = {"Content-Type": "application/json"}
    response = minilm.post("/v1/embeddings", content=chunks(), headers=headers)
    error = _error(response, 413, f"limit of {BODY_LIMIT} bytes")
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("route", "body", "param", "phrase"),
    [
        ("/v1/embeddings", {"input": 5}, "input", "input"),
        ("/v1/embeddings", {"input": [1, True]}, "input", "input"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format", "hex"),
        ("/v1/embeddings", {"input": "a", "frobnicate": 1}, "frobnicate", "unknown field"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": True}, "top_n", "top_n"),
        ("/detokenize", {"tokens": [True]}, "tokens", "tokens"),
        ("/v1/chat/completions", {"model": MINILM}, "messages", "required"),
    ],
)
def test_schema_errors_are_400_with_param(minilm, route, body, param, phrase) -> None:
    error = _error(minilm.post(route, json=body), 400, phrase)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_http_errors_have_openai_types_and_allow(minilm) -> None:
    error = _error(minilm.get("/v2/nothing"), 404, "no such route")
    assert error["type"] == "not_found_error"
    response = minilm.get("/v1/embeddings")
    error = _error(response, 405, "POST")
    assert error["type"] == "invalid_request_error" and response.headers["Allow"] == "POST"


# ---- small routes and the contract ---------------------------------------------------------------


def test_health_metrics_models(minilm) -> None:
    health = minilm.get("/health")
    assert health.json() == {"status": "ok"}
    assert health.headers["content-type"] == "application/json"
    assert minilm.get("/metrics").headers["content-type"].startswith("text/plain")
    card = minilm.get("/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == MINILM  # the name, not the folder's path
    assert minilm.get(f"/v1/models/{MINILM}").json() == card
    error = _error(minilm.get("/v1/models/nope"), 404, "'nope' does not exist")
    assert error["type"] == "not_found_error"


def test_openapi_documents_bodies_and_statuses(minilm) -> None:
    """Errors are documented in OpenAI's shape, on text-embeddings-inference's routes in TEI's
    (with its 422 and 424), and in either where a path takes both APIs' bodies."""
    spec = minilm.get("/openapi.json").json()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            shapes = {"ErrorResponse"}
            if path in TEI_PATHS:
                shapes = {"TEIErrorResponse"}
            elif path in ("/rerank", "/tokenize"):
                shapes = {"ErrorResponse", "TEIErrorResponse"}
            assert ("422" in responses) == ("TEIErrorResponse" in shapes), (method, path)
            assert "200" in responses and responses["200"].get("content"), (method, path)
            if path != "/health":
                assert "401" in responses, (method, path)
            if method == "post":
                for status in ("400", "401", "413", "503"):
                    assert status in responses, (method, path, status)
                    schema = responses[status]["content"]["application/json"]["schema"]
                    refs = [s["$ref"] for s in schema.get("anyOf", [schema])]
                    assert {ref.rsplit("/", 1)[1] for ref in refs} == shapes, (path, status)
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    embeddings = spec["paths"]["/v1/embeddings"]["post"]["responses"]["200"]["content"]
    assert embeddings["application/json"]["schema"]["$ref"].endswith("/EmbeddingResponse")
    for route in ("/v1/models/{model}", "/invocations", "/v2/rerank", "/v1/completions"):
        assert route in spec["paths"]


# ---- embeddings: vLLM's options ------------------------------------------------------------------


def _embedding(minilm, **options) -> list[float]:
    response = minilm.post("/v1/embeddings", json={"input": "a cat", **options})
    assert response.status_code == 200, response.text
    return response.json()["data"][0]["embedding"]


def test_normalize_and_use_activation(minilm) -> None:
    assert np.linalg.norm(_embedding(minilm)) == pytest.approx(1.0, abs=1e-5)
    raw = _embedding(minilm, use_activation=False)
    assert np.linalg.norm(raw) > 1.5
    assert _embedding(minilm, normalize=False) == pytest.approx(raw, abs=1e-6)


@pytest.mark.parametrize(
    ("embed_dtype", "endianness", "numpy_dtype"),
    [("float32", "native", "<f4"), ("float16", "little", "<f2"), ("float16", "big", ">f2")],
)
def test_embed_dtype_and_endianness(minilm, embed_dtype, endianness, numpy_dtype) -> None:
    expected = np.array(_embedding(minilm), dtype=np.float32)
    options = {"encoding_format": "base64", "embed_dtype": embed_dtype, "endianness": endianness}
    got = np.frombuffer(base64.b64decode(_embedding(minilm, **options)), dtype=numpy_dtype)
    np.testing.assert_allclose(got.astype(np.float32), expected, atol=1e-3)


def test_bfloat16_and_bytes_encoding(minilm) -> None:
    expected = torch.tensor(_embedding(minilm)).to(torch.bfloat16)
    body = {"input": ["a cat", "a dog"], "encoding_format": "bytes", "embed_dtype": "bfloat16"}
    response = minilm.post("/v1/embeddings", json=body)
    assert response.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(response.headers["metadata"])
    first = metadata["data"][0]
    assert first["shape"] == [384] and first["start"] == 0 and first["end"] == 768
    assert metadata["data"][1]["end"] == len(response.content) == 1536
    raw = np.frombuffer(response.content[: first["end"]], dtype=np.int16).copy()
    assert torch.equal(torch.from_numpy(raw).view(torch.bfloat16), expected)
    _error(minilm.post("/v1/embeddings", json={"input": "a", "embed_dtype": "float16"}), 400)


def test_bytes_of_2048_inputs_keep_the_metadata_header_small(default_server) -> None:
    """vLLM's per-output metadata (~100 bytes each) would make a 213 KB header, refused by httpx,
    curl and proxies: past 2 KiB it follows the raw bytes in the body, the header names where."""
    texts = [f"text number {i}" for i in range(2048)]
    with httpx.Client(base_url=default_server.url, timeout=300) as client:
        got = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "bytes"})
        expected = client.post("/v1/embeddings", json={"input": texts}).json()
    assert got.status_code == 200, got.text
    assert len(got.headers["metadata"]) <= 2048
    metadata = json.loads(got.headers["metadata"])
    assert "data" not in metadata and metadata["usage"] == expected["usage"]
    assert metadata["data_end"] == len(got.content)
    items = json.loads(got.content[metadata["data_start"] : metadata["data_end"]])
    assert [item["index"] for item in items] == list(range(2048))
    decoded = [
        np.frombuffer(got.content[item["start"] : item["end"]], np.float32).reshape(item["shape"])
        for item in items
    ]
    floats = np.array([d["embedding"] for d in expected["data"]], dtype=np.float32)
    np.testing.assert_array_equal(np.stack(decoded), floats)


def test_matryoshka_dimensions_enforced(minilm) -> None:
    assert len(_embedding(minilm, dimensions=64)) == 64
    body = {"input": "a", "dimensions": 5}
    _error(minilm.post("/v1/embeddings", json=body), 400, "matryoshka_dimensions [384, 128, 64]")


def test_auto_truncate_embeddings(minilm) -> None:
    response = minilm.post("/v1/embeddings", json={"input": LONG_TEXT})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 256


def test_chat_on_an_embedding_model_says_it_does_not_generate(minilm) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    error = _error(
        minilm.post("/v1/chat/completions", json=body), 400, "task 'generate' is not supported"
    )
    assert error["param"] == "model"


def test_tokenize_return_token_strs(minilm) -> None:
    body = {"prompt": "hello world", "return_token_strs": True}
    result = minilm.post("/tokenize", json=body).json()
    assert result["token_strs"] == ["[CLS]", "hello", "world", "[SEP]"]


# ---- score and rerank ----------------------------------------------------------------------------


def test_score_field_spellings_agree(minilm) -> None:
    texts = ("How do cats sleep?", ["Cats nap.", "Paris is in France."])
    scores = []
    for first, second in (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2")):
        response = minilm.post("/score", json={first: texts[0], second: texts[1]})
        assert response.status_code == 200, response.text
        scores.append([d["score"] for d in response.json()["data"]])
    assert scores[0] == scores[1] == scores[2]
    mixed = {"queries": texts[0], "text_2": texts[1]}
    _error(minilm.post("/score", json=mixed), 400, "one pair of fields")


def test_rerank_cuts_documents_to_fit_and_says_so(minilm) -> None:
    body = {"query": "word", "documents": ["a cat", LONG_TEXT, "word word"]}
    jina = minilm.post("/rerank", json=body)
    assert jina.status_code == 200, jina.text
    assert jina.json()["usage"]["truncated_documents"] == 1
    cohere = minilm.post("/v2/rerank", json=body).json()
    assert cohere["usage"]["truncated_documents"] == 1
    assert "1 document(s) were truncated" in cohere["meta"]["warnings"][0]
    short = minilm.post("/v2/rerank", json={**body, "max_tokens_per_doc": 2}).json()
    assert short["usage"]["truncated_documents"] == 3
    _error(minilm.post("/rerank", json={**body, "query": LONG_TEXT}), 400, "query 0 has 302")
    score = {"text_1": "a", "text_2": ["b", "c", "d", LONG_TEXT]}
    _error(minilm.post("/score", json=score), 400, "document 3 has 302 tokens")


def test_score_takes_truncation_side_as_llm_score_does(minilm, llm_fp32) -> None:
    """/score and LLM.score share the plan and the params: truncation_side cuts documents
    from the side asked, with the same numbers."""
    from cenote import PoolingParams

    document = "cats nap all day " * 4 + "paris is in france"
    scores = {}
    for side in ("left", "right"):
        body = {"queries": "where is paris", "documents": [document],
                "truncate_prompt_tokens": 8, "truncation_side": side}  # fmt: skip
        response = minilm.post("/score", json=body)
        assert response.status_code == 200, response.text
        scores[side] = response.json()["data"][0]["score"]
        params = PoolingParams(truncate_prompt_tokens=8, truncation_side=side)
        (offline,) = llm_fp32.score("where is paris", document, params, use_tqdm=False)
        assert scores[side] == pytest.approx(offline.outputs.score, abs=1e-5)
    assert scores["left"] > scores["right"] + 0.05  # the end of the document names paris
    bad = minilm.post("/score", json={"text_1": "a", "text_2": "b", "truncation_side": "up"})
    _error(bad, 400, "truncation_side")


def test_invocations_dispatch_by_body(minilm) -> None:
    response = minilm.post("/invocations", json={"input": "a cat"})
    assert response.json()["data"][0]["embedding"] == pytest.approx(_embedding(minilm), abs=1e-6)
    rerank = minilm.post("/invocations", json={"query": "a", "documents": ["b", "c"]}).json()
    assert len(rerank["results"]) == 2
    _error(minilm.post("/invocations", json={"what": 1}), 400, "cannot tell which API")


# ---- generation on SmolLM2 -------------------------------------------------------------------------


def _complete(smol, route: str = "/v1/completions", **body) -> dict:
    response = smol.post(route, json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_served_name_is_the_file_name(smol) -> None:
    card = smol.get(f"/v1/models/{smol.name}").json()
    assert card["id"] == card["root"] == smol.name and "/" not in card["id"]
    error = _error(smol.post("/v1/completions", json={"prompt": "a", "model": "x"}), 404)
    assert "/" not in error["message"].split("serves")[1]


def test_content_parts_and_roles(smol) -> None:
    text = [{"role": "user", "content": "Say hi"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]
    route = "/v1/chat/completions"
    plain = _complete(smol, route, messages=text, max_tokens=4)
    assert _complete(smol, route, messages=parts, max_tokens=4)["choices"] == plain["choices"]
    bad_role = [{"role": "<|im_start|>system", "content": "x"}]
    _error(smol.post(route, json={"messages": bad_role}), 400, "messages.0.role", "'user'")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    _error(smol.post(route, json={"messages": image}), 400, "text parts only")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "required"),
        ("functions", [{"name": "f"}]),
    ],
)
def test_unsupported_fields_are_refused_by_name(smol, field, value) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    error = _error(smol.post("/v1/chat/completions", json=body), 400, field)
    assert error["param"] == field


def test_logit_bias_forces_a_token(smol) -> None:
    token = smol.post("/tokenize", json={"prompt": " banana"}).json()["tokens"][-1]
    result = _complete(
        smol, prompt="Hello", max_tokens=3, logit_bias={str(token): 100}, return_token_ids=True
    )
    assert result["choices"][0]["token_ids"] == [token] * 3
    _error(smol.post("/v1/completions", json={"prompt": "a", "logit_bias": {"x": 1}}), 400)


def test_max_tokens_defaults_and_zero(smol) -> None:
    completion = _complete(smol, prompt="Once upon a time", ignore_eos=True)
    assert completion["usage"]["completion_tokens"] == 16
    messages = [{"role": "user", "content": "Tell a story"}]
    chat = _complete(smol, "/v1/chat/completions", messages=messages, ignore_eos=True)
    assert chat["usage"]["total_tokens"] == SMOL_LEN  # the rest of the context
    _error(smol.post("/v1/completions", json={"prompt": "a", "max_tokens": 0}), 400, "max_tokens")


def test_n_beyond_capacity_is_400_not_429(smol) -> None:
    error = _error(smol.post("/v1/completions", json={"prompt": "a", "n": 5}), 400, "at most 4")
    assert error["param"] == "n"


def test_echo_with_logprobs_covers_the_prompt(smol) -> None:
    prompt = "The capital of France is"
    num_prompt = len(smol.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    choice = _complete(smol, prompt=prompt, max_tokens=3, echo=True, logprobs=1)["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert len(logprobs["tokens"]) == num_prompt + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][0] == 0
    assert "".join(logprobs["tokens"][:num_prompt]) == prompt
    assert logprobs["text_offset"][num_prompt] == len(prompt)


def test_logprobs_zero_gives_the_sampled_token(smol) -> None:
    logprobs = _complete(smol, prompt="Hello", max_tokens=3, logprobs=0)["choices"][0]["logprobs"]
    for token, value, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert top == {token: value}


def test_prompt_logprobs_and_token_ids(smol) -> None:
    result = _complete(
        smol, prompt="Hello there", max_tokens=2, prompt_logprobs=1, return_token_ids=True
    )
    choice = result["choices"][0]
    prompt_ids = choice["prompt_token_ids"]
    assert (
        len(choice["prompt_logprobs"]) == len(prompt_ids) and choice["prompt_logprobs"][0] is None
    )
    assert str(prompt_ids[1]) in choice["prompt_logprobs"][1]
    assert len(choice["token_ids"]) == result["usage"]["completion_tokens"]


def _events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_stream_n_sends_each_finish_reason_once(smol) -> None:
    body = {"prompt": "Hi", "max_tokens": 5, "n": 3, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    chunks = _events(smol.post("/v1/completions", json=body))
    finishes = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2]
    assert all("usage" in chunk for chunk in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 15


def test_continue_final_message(smol) -> None:
    messages = [
        {"role": "user", "content": "Count to five"},
        {"role": "assistant", "content": "One, two,"},
    ]
    both = {"messages": messages, "continue_final_message": True}
    _error(smol.post("/v1/chat/completions", json=both), 400, "cannot both be true")
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    tokens = smol.post("/tokenize", json=body).json()["tokens"]
    text = smol.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text.endswith("One, two,")
    closed = smol.post("/tokenize", json={**body, "continue_final_message": False}).json()
    assert len(closed["tokens"]) > len(tokens)  # the end-of-turn tokens stay out


def test_messages_default_to_no_special_tokens(smol) -> None:
    """vLLM: the chat template writes the special tokens, so none are added to messages."""
    messages = [{"role": "user", "content": "hi"}]
    default = smol.post("/tokenize", json={"messages": messages}).json()["tokens"]
    explicit = {"messages": messages, "add_special_tokens": False}
    assert smol.post("/tokenize", json=explicit).json()["tokens"] == default
    strs = smol.post("/tokenize", json={**explicit, "return_token_strs": True}).json()
    assert strs["token_strs"][0] == "<|im_start|>"  # the template's, once


def test_invocations_generate(smol) -> None:
    result = smol.post("/invocations", json={"prompt": "Hello", "max_tokens": 2}).json()
    assert result["object"] == "text_completion"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert smol.post("/invocations", json=chat).json()["object"] == "chat.completion"
