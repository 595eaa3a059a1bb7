"""``cenote run-batch``: OpenAI batch files through the offline engine. Good lines equal the
offline API; each bad line gets its own error object and the others are unaffected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factories.decoders import make_decoder
from factories.generation import make_llm
from factories.processes import run_cenote
from factories.tokenized import record_tokenized

from cenote.cli.run_batch import BatchLimits, run_batch
from cenote.sampling_params import SamplingParams
from cenote.server.batch_reader import BatchFileError

LONG_TEXT = "word " * 400  # more than all-MiniLM-L6-v2's 256 tokens
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5{% endif %}"


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(llm, tmp_path: Path, lines: list[str], limits: BatchLimits | None = None) -> list[dict]:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    summary = run_batch(llm, source, target, lines_per_chunk=4, limits=limits)  # several chunks
    results = [json.loads(line) for line in target.read_text().splitlines()]
    assert summary.num_lines == len(results) == len(lines)
    assert not list(tmp_path.glob(".*.tmp"))
    return results


def _error(result: dict) -> tuple[int, str]:
    assert result["response"]["body"]["error"]["message"] == result["error"]["message"]
    return result["response"]["status_code"], result["error"]["message"]


@pytest.fixture
def tokenized(monkeypatch) -> list[int]:
    return record_tokenized(monkeypatch)


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
    error = _error
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


def test_a_line_that_cannot_be_parsed_fails_alone_and_the_output_is_written(llm_fp32, tmp_path):
    deep = "[" * 10_000 + "]" * 10_000
    lines = [
        _line("a", "/v1/embeddings", {"input": "first"}),
        '{"custom_id": "deep", "method": "POST", "url": "/v1/embeddings", "body": ' + deep + "}",
        _line("nested", "/v1/embeddings", {"input": json.loads("[" * 500 + "]" * 500)}),
        _line("long", "/v1/embeddings", {"input": "x" * 40_000}),
        _line("b", "/v1/embeddings", {"input": "last"}),
    ]
    results = _run(llm_fp32, tmp_path, lines, BatchLimits(max_line_bytes=30_000))
    expected = [o.outputs.data for o in llm_fp32.embed(["first", "last"], use_tqdm=False)]
    for result, ref in zip((results[0], results[4]), expected, strict=True):
        assert result["error"] is None
        got = torch.tensor(result["response"]["body"]["data"][0]["embedding"])
        assert torch.allclose(got, ref, atol=1e-6)
    status, message = _error(results[1])
    assert results[1]["custom_id"] is None  # unknowable: the line cannot be parsed
    assert status == 400 and message.startswith("line 2 nests JSON too deeply to parse")
    status, message = _error(results[2])
    assert results[2]["custom_id"] == "nested" and status == 422 and "line 3" in message
    status, message = _error(results[3])
    assert results[3]["custom_id"] is None and status == 413
    assert (
        message
        == f"line 4 has {len(lines[3]) + 1} bytes, more than the limit of 30000 (--max-line-bytes)"
    )


def test_repeated_custom_ids_refuse_the_whole_file_before_anything_runs(tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        _line("x", "/v1/embeddings", {"input": "a"}),
        _line("y", "/v1/embeddings", {"input": "b"}),
        "[" * 10_000 + "]" * 10_000,  # unreadable lines fail on their own when the batch runs
        _line("x", "/v1/embeddings", {"input": "c"}),
        _line("z", "/v1/embeddings", {"input": "d"}),
        _line("y", "/v1/nope", {"input": "e"}),
    ]
    source.write_text("\n".join(lines) + "\n")
    # no engine: refused before the first line would need one
    with pytest.raises(BatchFileError) as info:
        run_batch(None, source, target)
    assert str(info.value) == (
        f"{source}: 2 lines repeat an earlier line's custom_id: 'x' on line 1 and line 4; "
        "'y' on line 2 and line 6; every custom_id in a batch must be unique"
    )
    assert list(tmp_path.iterdir()) == [source]


def test_texts_are_bounded_by_characters_before_they_are_tokenized(llm_fp32, tmp_path, tokenized):
    limit = BatchLimits().max_input_chars  # the server's --max-input-chars
    assert limit == 1 << 20
    long_text, text = "word " * (limit // 5 + 1), "cats and dogs " * 40_000  # 1 MiB + 5; 560,000
    lines = [
        _line("huge-line", "/v1/embeddings", {"input": "word " * (4 << 20)}),  # 20 MiB
        _line("long", "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": -1}),
        _line("three", "/v1/embeddings", {"input": [text] * 3, "truncate_prompt_tokens": -1}),
        _line("score", "/v1/score", {"text_1": "cats", "text_2": ["dogs", long_text]}),
        _line("rerank", "/v1/rerank", {"query": long_text, "documents": ["dogs"]}),
    ]
    results = {r["custom_id"] or "huge-line": r for r in _run(llm_fp32, tmp_path, lines)}
    status, message = _error(results["huge-line"])
    assert status == 413 and f"line 1 has {len(lines[0]) + 1} bytes" in message
    assert _error(results["long"]) == (
        400,
        f"line 2: prompt 0 has {len(long_text)} characters, more than the limit of {limit} "
        "(max_input_chars)",
    )
    # texts under the bound run, tokenized a group of at most the bound at a time
    (expected,) = llm_fp32.embed([text], truncate_prompt_tokens=-1, use_tqdm=False)
    data = results["three"]["response"]["body"]["data"]
    assert results["three"]["response"]["body"]["usage"]["prompt_tokens"] == 3 * 256
    assert torch.allclose(torch.tensor(data[2]["embedding"]), expected.outputs.data, atol=1e-6)
    assert _error(results["score"]) == (
        400,
        f"line 4: text_2[1] has {len(long_text)} characters, more than the limit of {limit} "
        "(--max-input-chars)",
    )
    assert _error(results["rerank"])[1].startswith("line 5: query[0] has 1048580 characters")
    assert tokenized and max(tokenized) <= limit


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


def test_cli_writes_output_in_bounded_memory_and_refuses_bad_files(tmp_path):
    # a 20 MB line and a 10 MB text among good lines: refused unread, in bounded memory
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        _line("a", "/v1/embeddings", {"input": "hello"}),
        _line("b", "/v1/embeddings", {"input": "word " * 4_000_000}),
        _line("c", "/v1/embeddings", {"input": "word " * 2_000_000}),
        _line("d", "/v1/embeddings", {"input": "world"}),
    ]
    source.write_text("\n".join(lines) + "\n")
    command = ["run-batch", "--dtype", "float32"]
    done = run_cenote([*command, "-i", str(source), "-o", str(target)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"4 lines, 2 failed -> {target}" in done.stdout
    results = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["response"]["status_code"] for r in results] == [200, 413, 400, 200]
    assert len(results[0]["response"]["body"]["data"][0]["embedding"]) == 384
    assert "10000000 characters, more than the limit of 1048576" in results[2]["error"]["message"]
    assert done.peak_rss_mib < 1500  # tokenizing the two whole: some 4,000 MiB
    # refused files: no output, the reason, no traceback
    missing = tmp_path / "missing.jsonl"
    repeated = tmp_path / "repeated.jsonl"
    repeated.write_text(lines[0] + "\n" + lines[0] + "\n")
    for path, reason in [
        (missing, f"cannot read the batch file {missing}"),
        (repeated, "'a' on line 1 and line 2; every custom_id in a batch must be unique"),
    ]:
        done = run_cenote([*command, "-i", str(path), "-o", str(tmp_path / "no.jsonl")], tmp_path)
        assert done.returncode == 1
        assert reason in done.stderr and "Traceback" not in done.stderr
        assert not (tmp_path / "no.jsonl").exists()
