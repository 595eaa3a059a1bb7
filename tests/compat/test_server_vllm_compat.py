"""What running vLLM's own server tests against ``cenote serve`` found (issue 8; docs/
vllm-compat.md): a ``--chat-template`` for models without one, ``/score`` with ``queries`` and
``items``, ``max_tokens_per_doc: 0`` as "no cut", ``/tokenize`` answering ``token_strs: null``,
class labels named as transformers names them when the config has no ``id2label``; streams of
one choice per chunk, ``continuous_usage_stats`` only with ``include_usage``, and
``prompt_logprobs`` / ``prompt_token_ids`` null unless asked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from cenote import LLM
from tests.factories.encoders import make_encoder_classifier
from tests.server_fixture import ServerProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEMPLATE = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
MESSAGES = [
    {"role": "user", "content": "The cat sat on the mat."},
    {"role": "assistant", "content": "A feline was resting on a rug."},
]
RENDERED = "user: The cat sat on the mat.\nassistant: A feline was resting on a rug.\n"


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory):
    """The default model, which has no chat template, given one through a file."""
    template_file = tmp_path_factory.mktemp("template") / "template.jinja"
    template_file.write_text(TEMPLATE)
    server = ServerProcess(
        "--dtype", "float32", "--num-threads", "1", "--chat-template", str(template_file)
    )  # fmt: skip
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client
    finally:
        server.stop()


def _post(client: httpx.Client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_template_option_renders_messages(minilm) -> None:
    tokenized = _post(minilm, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    expected = _post(minilm, "/tokenize", {"prompt": RENDERED, "add_special_tokens": False})
    assert tokenized["tokens"] == expected["tokens"]
    chat = _post(minilm, "/v1/embeddings", {"messages": MESSAGES})
    text = _post(minilm, "/v1/embeddings", {"input": RENDERED, "add_special_tokens": False})
    assert chat["usage"] == text["usage"]
    torch.testing.assert_close(
        torch.tensor(chat["data"][0]["embedding"]), torch.tensor(text["data"][0]["embedding"])
    )


def test_chat_template_option_reads_text_too(tmp_path: Path) -> None:
    from cenote.cli.main import _chat_template

    assert _chat_template(TEMPLATE) == TEMPLATE
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert _chat_template(str(tmp_path / "t.jinja")) == TEMPLATE
    assert _chat_template(None) is None


def test_score_queries_with_items_as_with_documents(minilm) -> None:
    queries, documents = ["a cat", "a dog"], ["the cat sat", "the dog ran"]
    with_items = _post(minilm, "/score", {"queries": queries, "items": documents})
    with_documents = _post(minilm, "/score", {"queries": queries, "documents": documents})
    assert [d["score"] for d in with_items["data"]] == [d["score"] for d in with_documents["data"]]
    for body in (
        {"queries": queries, "items": documents, "documents": documents},
        {"text_1": queries, "items": documents},
        {"items": documents},
    ):
        response = minilm.post("/score", json=body)
        assert response.status_code == 400, body
        assert "one pair of fields" in response.json()["error"]["message"]


def test_max_tokens_per_doc_zero_cuts_nothing(minilm) -> None:
    body = {"query": "cat", "documents": ["the cat sat on the mat " * 20, "dog"]}
    uncut = _post(minilm, "/rerank", body)
    zero = _post(minilm, "/rerank", {**body, "max_tokens_per_doc": 0})
    assert zero["results"] == uncut["results"]
    assert zero["usage"]["prompt_tokens"] == uncut["usage"]["prompt_tokens"]
    cut = _post(minilm, "/rerank", {**body, "max_tokens_per_doc": 3})
    assert cut["usage"]["prompt_tokens"] < uncut["usage"]["prompt_tokens"]
    response = minilm.post("/rerank", json={**body, "max_tokens_per_doc": -5})
    assert response.status_code == 400
    assert "greater than or equal to 0" in response.json()["error"]["message"]


def test_tokenize_token_strs_null_unless_asked(minilm) -> None:
    plain = _post(minilm, "/tokenize", {"prompt": "hello world"})
    assert "token_strs" in plain and plain["token_strs"] is None
    asked = _post(minilm, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert asked["token_strs"] == ["[CLS]", "hello", "world", "[SEP]"]


def test_classifier_without_id2label_names_labels_as_transformers(tmp_path: Path) -> None:
    reference = make_encoder_classifier(tmp_path, "bert", "ForSequenceClassification", num_labels=3)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("id2label", None)
    saved.pop("label2id", None)
    saved["num_labels"] = 3  # the count alone, as configs without label names give it
    (tmp_path / "config.json").write_text(json.dumps(saved))
    names = transformers.AutoConfig.from_pretrained(tmp_path).id2label  # transformers' defaults
    llm = LLM(str(tmp_path), dtype="float32", num_threads=1)
    prompts = [[2, 7, 9, 3], [2, 11, 3], [2, 5, 6, 8, 3]]  # [CLS] words [SEP]
    outputs = llm.classify([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
    for ids, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([ids])).logits[0]  # [num_labels]
        assert out.outputs.label == names[int(logits.argmax())]
        assert out.outputs.label.startswith("LABEL_")


@pytest.fixture(scope="module")
def smol(smollm2_server):
    """The session's SmolLM2 server (conftest), shared with other modules."""
    with httpx.Client(base_url=smollm2_server.url, timeout=120) as client:
        yield client


def _stream(client: httpx.Client, body: dict, route: str = "/v1/completions") -> list[dict]:
    chunks = []
    with client.stream("POST", route, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def test_stream_sends_one_choice_per_chunk(smol) -> None:
    # n=3 at temperature 1 with this seed: two samples end at their first token (EOS) in the
    # same step, which used to share one chunk
    body = {"prompt": "What is an LLM?", "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 42}
    whole = _post(smol, "/v1/completions", body)["choices"]
    chunks = _stream(smol, body)
    assert all(len(chunk["choices"]) == 1 for chunk in chunks)
    finishes = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2]
    texts = ["", "", ""]
    for chunk in chunks:
        texts[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert texts == [c["text"] for c in whole]


def test_continuous_usage_only_with_include_usage(smol) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    alone = _stream(smol, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all(chunk.get("usage") is None for chunk in alone)
    both = {"include_usage": True, "continuous_usage_stats": True}
    with_usage = _stream(smol, {**body, "stream_options": both})
    assert all(chunk["usage"]["completion_tokens"] >= 1 for chunk in with_usage)
    assert with_usage[-1]["choices"] == []


def test_prompt_fields_null_unless_asked(smol) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    choice = _post(smol, "/v1/completions", body)["choices"][0]
    assert choice["prompt_logprobs"] is None and choice["prompt_token_ids"] is None
    asked = {**body, "prompt_logprobs": 1, "return_token_ids": True}
    choice = _post(smol, "/v1/completions", asked)["choices"][0]
    assert len(choice["prompt_logprobs"]) == len(choice["prompt_token_ids"]) > 1
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    assert _post(smol, "/v1/chat/completions", chat)["prompt_logprobs"] is None


def test_continuous_usage_in_every_chat_chunk(smol) -> None:
    """Chat's first chunk (the assistant role) carries usage too: the prompt, 0 completion."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    both = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _stream(smol, {**body, "stream_options": both}, "/v1/chat/completions")
    assert chunks[0]["usage"]["completion_tokens"] == 0 and chunks[0]["usage"]["prompt_tokens"] > 0
    assert all(chunk["usage"]["prompt_tokens"] > 0 for chunk in chunks)
