"""``cenote run-batch``: OpenAI batch files through the offline engine. Good lines equal the
offline API; each bad line gets its own error object and the others are unaffected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from factories.decoders import make_decoder
from factories.generation import make_llm

from cenote.entrypoints.run_batch import run_batch
from cenote.sampling_params import SamplingParams

LONG_TEXT = "word " * 400  # more than all-MiniLM-L6-v2's 256 tokens
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5{% endif %}"


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(llm, tmp_path: Path, lines: list[str]) -> list[dict]:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    summary = run_batch(llm, source, target, lines_per_chunk=4)  # several chunks
    results = [json.loads(line) for line in target.read_text().splitlines()]
    assert summary.num_lines == len(results) == len(lines)
    return results


def test_pooling_lines_equal_offline_and_bad_lines_fail_alone(llm_fp32, tmp_path):
    texts = ["a sentence about cats", "another about dogs"]
    lines = [
        _line("emb", "/v1/embeddings", {"input": texts}),
        "{not json",
        _line("unknown-url", "/v1/fine_tuning", {"input": "x"}),
        _line("too-long", "/v1/embeddings", {"input": ["fine", LONG_TEXT]}),
        "",
        _line("bad-type", "/v1/embeddings", {"input": 5}),
        _line("empty", "/v1/embeddings", {"input": []}),
        _line("other-model", "/v1/embeddings", {"input": "x", "model": "nope"}),
        _line("score", "/v1/score", {"text_1": "cats", "text_2": texts}),
        _line("rerank", "/v1/rerank", {"query": "dogs", "documents": texts, "top_n": 1}),
        _line("long-doc", "/v1/rerank", {"query": "dogs", "documents": ["dogs", LONG_TEXT]}),
        _line("truncated", "/v1/embeddings", {"input": LONG_TEXT, "truncate_prompt_tokens": -1}),
        json.dumps({"method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
    ]
    results = _run(llm_fp32, tmp_path, lines)
    by_id = {r["custom_id"]: r for r in results if r["custom_id"] is not None}

    # good lines: 200 and the offline engine's numbers, in the route's shape
    expected = [o.outputs.data for o in llm_fp32.embed(texts, use_tqdm=False)]
    emb = by_id["emb"]
    assert emb["error"] is None and emb["response"]["status_code"] == 200
    data = emb["response"]["body"]["data"]
    assert [d["index"] for d in data] == [0, 1]
    for d, ref in zip(data, expected, strict=True):
        assert torch.allclose(torch.tensor(d["embedding"]), ref, atol=1e-6)
    assert emb["response"]["body"]["usage"]["prompt_tokens"] > 0
    scores = [s.outputs.score for s in llm_fp32.score("cats", texts, use_tqdm=False)]
    got = [d["score"] for d in by_id["score"]["response"]["body"]["data"]]
    assert got == pytest.approx(scores, abs=1e-6)
    rerank = by_id["rerank"]["response"]["body"]["results"]
    dog_scores = [s.outputs.score for s in llm_fp32.score("dogs", texts, use_tqdm=False)]
    best = max(range(2), key=lambda i: dog_scores[i])
    assert [r["index"] for r in rerank] == [best]
    assert rerank[0]["document"] == {"text": texts[best]}
    assert by_id["truncated"]["response"]["status_code"] == 200
    # rerank cuts documents to fit the model, as the route does
    assert by_id["long-doc"]["response"]["status_code"] == 200
    assert len(by_id["long-doc"]["response"]["body"]["results"]) == 2

    # bad lines: their own status and a message naming the line and the reason
    def error(result: dict) -> tuple[int, str]:
        assert result["response"]["body"]["error"]["message"] == result["error"]["message"]
        return result["response"]["status_code"], result["error"]["message"]

    status, message = error(results[1])
    assert results[1]["custom_id"] is None and status == 400
    assert "line 2 is not valid JSON" in message
    status, message = error(by_id["unknown-url"])
    assert status == 404 and "line 3: unknown url '/v1/fine_tuning'" in message
    assert "/v1/embeddings" in message
    status, message = error(by_id["too-long"])
    assert status == 400 and "line 4" in message and "256" in message
    status, message = error(results[4])
    assert status == 400 and "line 5 is empty" in message
    status, message = error(by_id["bad-type"])
    assert status == 422 and "line 6" in message and "input" in message
    status, message = error(by_id["empty"])
    assert status == 400 and "empty" in message
    status, message = error(by_id["other-model"])
    assert status == 404 and "'nope'" in message
    status, message = error(results[-1])
    assert status == 400 and "custom_id" in message
    # every output line is in the batch output shape
    for r in results:
        assert set(r) == {"id", "custom_id", "response", "error"}
        assert set(r["response"]) == {"status_code", "request_id", "body"}


def test_generation_lines_equal_offline(tmp_path):
    folder = tmp_path / "llama"
    make_decoder(folder, "llama")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    llm = make_llm(folder)
    prompt, messages = "w3 w4 w5 w6", [{"role": "user", "content": "w7 w8"}]
    lines = [
        _line("cmpl", "/v1/completions", {"prompt": [prompt, "w9 w10"], "max_tokens": 5, "temperature": 0}),
        _line("chat", "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0}),
        _line("too-many", "/v1/completions", {"prompt": prompt, "max_tokens": 10_000}),
        _line("stream", "/v1/completions", {"prompt": prompt, "stream": True}),
        _line("logprobs", "/v1/chat/completions", {"messages": messages, "logprobs": True}),
        _line("cut", "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                         "truncate_prompt_tokens": 2}),
    ]  # fmt: skip
    results = {r["custom_id"]: r for r in _run(llm, tmp_path, lines)}

    greedy = SamplingParams(temperature=0, max_tokens=5)
    expected = [o.outputs[0].text for o in llm.generate([prompt, "w9 w10"], greedy, use_tqdm=False)]
    body = results["cmpl"]["response"]["body"]
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == expected
    assert [c["index"] for c in body["choices"]] == [0, 1]
    chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    body = results["chat"]["response"]["body"]
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": chat[0].outputs[0].text,
    }
    assert body["usage"]["completion_tokens"] == len(chat[0].outputs[0].token_ids)
    assert results["too-many"]["response"]["status_code"] == 400
    assert "max_model_len" in results["too-many"]["error"]["message"]
    assert "stream" in results["stream"]["error"]["message"]
    assert "logprobs" in results["logprobs"]["error"]["message"]
    # the routes' translation: truncation travels in the params (generation keeps the end)
    cut = SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=2)
    (expected_cut,) = llm.generate([prompt], cut, use_tqdm=False)
    body = results["cut"]["response"]["body"]
    assert body["usage"]["prompt_tokens"] == 2
    assert body["choices"][0]["text"] == expected_cut.outputs[0].text
    assert expected_cut.prompt_token_ids == llm.tokenizer.encode(prompt).ids[-2:]


def test_cli_writes_output_and_names_a_missing_file(tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_line("a", "/v1/embeddings", {"input": "hello"}) + "\n")
    command = [sys.executable, "-m", "cenote", "run-batch", "--dtype", "float32"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [*command, "-i", str(source), "-o", str(target)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    (result,) = [json.loads(line) for line in target.read_text().splitlines()]
    assert (
        result["custom_id"] == "a"
        and len(result["response"]["body"]["data"][0]["embedding"]) == 384
    )
    missing = tmp_path / "missing.jsonl"
    done = subprocess.run(
        [*command, "-i", str(missing), "-o", str(target)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert f"cannot read the batch file {missing}" in done.stderr
    assert "Traceback" not in done.stderr
