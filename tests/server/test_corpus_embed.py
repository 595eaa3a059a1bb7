"""``cenote embed``: corpus readers (JSONL, CSV, Parquet, text) and their errors, atomic part
files, the .npy export, and resuming after a real ``kill -9`` with exactly the rows of an
uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from factories.corpus import LONG_TEXT, corpus, embed_job, read_output, write_jsonl
from factories.processes import run_cenote
from factories.texts import PROSE
from factories.tokenized import record_tokenized

from cenote.apps.corpus.embedder import CHARS_PER_TOKEN, MAX_PASSAGE_CHARS, RowError, embed_passages
from cenote.apps.corpus.readers import CorpusError, open_source, read_chunks

# ---- readers ----------------------------------------------------------------------------------


def test_every_format_reads_the_same_rows(tmp_path):
    rows = corpus(25)
    table = pa.table({"doc": [r["doc"] for r in rows], "body": [r["body"] for r in rows]})
    write_jsonl(tmp_path / "c.jsonl", rows)
    pcsv.write_csv(table, tmp_path / "c.csv")
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=7)
    (tmp_path / "c.txt").write_text("".join(r["body"] + "\n" for r in rows))
    expected_texts = [r["body"] for r in rows]
    for name in ("c.jsonl", "c.csv", "c.parquet"):
        source = open_source(tmp_path / name, "body", "doc")
        chunks = list(read_chunks(source, 10))
        assert [c.first_row for c in chunks] == [0, 10, 20], name
        assert [t for c in chunks for t in c.texts] == expected_texts, name
        assert [i for c in chunks for i in c.ids] == [r["doc"] for r in rows], name
    chunks = list(read_chunks(open_source(tmp_path / "c.txt"), 10))
    assert [t for c in chunks for t in c.texts] == expected_texts
    assert all(c.ids is None for c in chunks)


@pytest.mark.parametrize(
    "name, content, fields, message",
    [
        ("a.jsonl", '{"text": "ok"}\n{"body": "x"}\n', {}, "a.jsonl line 2 has no field 'text' (its fields: 'body')"),
        ("a.jsonl", '{"text": "ok"}\n\n{"text": "x"}\n', {}, "a.jsonl line 2 is empty"),
        ("a.jsonl", '{"text": "ok"}\n{"text": \n', {}, "a.jsonl line 2 is not valid JSON"),
        ("a.jsonl", '{"text": "ok"}\n{"text": 3}\n', {}, "a.jsonl line 2: 'text' is a int, not text"),
        ("a.jsonl", '{"text": "ok", "id": 1}\n{"text": "x"}\n', {"id_field": "id"}, "a.jsonl line 2 has no field 'id'"),
        ("a.txt", "one\n\nthree\n", {}, "a.txt line 2 is empty"),
        ("a.csv", "id,body\n1,x\n", {}, "a.csv: no column 'text' (its columns: 'id', 'body')"),
        ("a.csv", 'text\nfine\n""\n', {}, "a.csv row 2: 'text' is empty"),
    ],
)  # fmt: skip
def test_bad_records_name_the_file_and_line(tmp_path, name, content, fields, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(CorpusError) as info:
        list(read_chunks(open_source(path, **fields), 10))
    assert str(info.value).startswith(str(tmp_path / message.split(" ")[0]))
    assert message in str(info.value)


def test_unreadable_inputs(tmp_path):
    with pytest.raises(CorpusError, match=f"cannot read {tmp_path / 'missing.jsonl'}"):
        open_source(tmp_path / "missing.jsonl")
    with pytest.raises(CorpusError, match=f"cannot read {tmp_path}: Is a directory"):
        open_source(tmp_path)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(CorpusError, match="bad.parquet is not a readable Parquet file"):
        list(read_chunks(open_source(tmp_path / "bad.parquet"), 10))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CorpusError, match="empty.txt holds no passages"):
        embed_job(None, open_source(tmp_path / "empty.txt"), tmp_path / "e.npy")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "ok.parquet")
    with pytest.raises(CorpusError, match="no column 'text' \\(its columns: 'body'\\)"):
        list(read_chunks(open_source(tmp_path / "ok.parquet"), 10))


# ---- the job ----------------------------------------------------------------------------------


def test_parts_equal_llm_embed_and_npy_export(llm_fp32, tmp_path):
    rows = corpus(50)
    source = open_source(write_jsonl(tmp_path / "c.jsonl", rows), "body", "doc")
    embed_job(llm_fp32, source, tmp_path / "out", rows_per_part=16)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "_manifest.json", *[f"part-{i:06d}.parquet" for i in range(4)]
    ]  # fmt: skip
    ids, embeddings, num_tokens = read_output(tmp_path / "out")
    outputs = llm_fp32.embed([r["body"] for r in rows], use_tqdm=False)
    expected = np.stack([o.outputs.data.numpy() for o in outputs])
    assert ids == [r["doc"] for r in rows]
    assert np.abs(embeddings - expected).max() <= 1e-6
    assert num_tokens == [len(o.prompt_token_ids) for o in outputs]

    embed_job(llm_fp32, source, tmp_path / "e.npy", rows_per_part=16)
    assert np.array_equal(np.load(tmp_path / "e.npy"), embeddings)
    id_table = pq.read_table(tmp_path / "e.ids.parquet")
    assert id_table.column("id").to_pylist() == ids
    assert id_table.column("num_tokens").to_pylist() == num_tokens


def test_too_long_passage_names_its_line_and_keeps_finished_parts(llm_fp32, tmp_path):
    rows = corpus(20)
    rows[13]["body"] = LONG_TEXT
    source = open_source(write_jsonl(tmp_path / "c.jsonl", rows), "body")
    with pytest.raises(CorpusError) as info:
        embed_job(llm_fp32, source, tmp_path / "out", rows_per_part=8)
    assert str(info.value).startswith(f"{tmp_path / 'c.jsonl'} line 14: the passage has 4")
    assert "--truncate" in str(info.value)
    assert [p.name for p in sorted((tmp_path / "out").glob("part-*"))] == ["part-000000.parquet"]
    # the same job with --truncate resumes (part 0 kept) and cuts the passage to 256 tokens
    with pytest.raises(
        CorpusError, match="holds the output of a different job \\(changed: truncate\\)"
    ):
        embed_job(llm_fp32, source, tmp_path / "out", rows_per_part=8, truncate=-1)
    embed_job(llm_fp32, source, tmp_path / "cut", rows_per_part=8, truncate=-1)
    ids, _, num_tokens = read_output(tmp_path / "cut")
    assert ids == list(range(20)) and num_tokens[13] == 256


def test_a_long_passage_cut_before_tokenizing_keeps_the_tokens_of_the_whole(llm_fp32):
    prose = " ".join(PROSE) + "\n\n"
    prose = prose * (40_000 // len(prose) + 1)  # 40,000 characters: past every first cut
    long_words = " ".join(f"{i:04d}" + "x" * 146 for i in range(1000))  # [UNK] each: 150 a token
    cases = [(prose[start:], n) for start in (0, 1, 7, 123) for n in (-1, 100, 7)]
    cases += [(long_words, -1), (long_words, 60)]  # the first cut holds too few tokens: wider
    for text, n in cases:
        got, num_tokens = embed_passages(llm_fp32, [text], truncate_prompt_tokens=n)
        (whole,) = llm_fp32.embed([text], truncate_prompt_tokens=n, use_tqdm=False)
        assert num_tokens[0] == len(whole.prompt_token_ids) == (256 if n == -1 else n)
        assert np.abs(got[0] - whole.outputs.data.numpy()).max() <= 1e-6, (text[:20], n)


def test_a_huge_passage_is_refused_or_cut_without_tokenizing_it(llm_fp32, tmp_path, monkeypatch):
    prose = " ".join(PROSE) + " "
    huge = prose * (20_000_000 // len(prose))  # 20 MB on one line
    (tmp_path / "c.txt").write_text(f"short one\n{huge}\nshort two\n")
    source = open_source(tmp_path / "c.txt")
    tokenized = record_tokenized(monkeypatch)
    with pytest.raises(CorpusError) as info:
        embed_job(llm_fp32, source, tmp_path / "out")
    assert str(info.value) == (
        f"{source.path} line 2: the passage has {len(huge)} characters, more than the limit of "
        f"{MAX_PASSAGE_CHARS} (max_input_chars); pass --truncate to embed its start"
    )
    assert MAX_PASSAGE_CHARS == 1 << 20  # the server's --max-input-chars
    embed_job(llm_fp32, source, tmp_path / "cut", truncate=-1)
    _, embeddings, num_tokens = read_output(tmp_path / "cut")
    assert num_tokens[1] == 256
    (start,) = llm_fp32.embed([huge[:100_000]], truncate_prompt_tokens=-1, use_tqdm=False)
    assert np.abs(embeddings[1] - start.outputs.data.numpy()).max() <= 1e-6
    assert max(tokenized) <= 100_000  # at most a cut's 256 * CHARS_PER_TOKEN, and the reference
    assert 256 * CHARS_PER_TOKEN < 100_000
    # a prefix of max_input_chars that still holds too few tokens: refused, not tokenized whole
    words = " ".join("x" * 10_000 for _ in range(300))  # 3 MB, [UNK] a word: 105 in 1 MiB
    with pytest.raises(RowError) as info:
        embed_passages(llm_fp32, ["fine", words], rows=[7, 8], truncate_prompt_tokens=-1)
    assert info.value.row == 8
    assert info.value.message == (
        f"the passage has {len(words)} characters and its first 1048576 (max_input_chars) hold "
        "no more than the 256 tokens truncation keeps; it is refused rather than tokenized whole"
    )
    assert max(tokenized) <= MAX_PASSAGE_CHARS


def test_cli_embeds_a_20_mb_passage_in_bounded_memory(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("short one\n" + "word " * 4_000_000 + "\n")
    args = ["embed", str(path), "-o", str(tmp_path / "out"), "--truncate", "--no-progress"]
    done = run_cenote([*args, "--dtype", "float32"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert read_output(tmp_path / "out")[2] == [4, 256]  # [CLS] short one [SEP]
    assert done.peak_rss_mib < 1500  # tokenizing the whole passage: some 3,000 MiB


def test_resume_after_kill_9_gives_the_rows_of_an_uninterrupted_run(llm_fp32, tmp_path):
    rows = corpus(1500)
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    reference = tmp_path / "reference"
    embed_job(llm_fp32, open_source(path, "body", "doc"), reference, rows_per_part=8)

    output = tmp_path / "out"
    command = [
        sys.executable, "-m", "cenote", "embed", str(path), "-o", str(output), "--text-field",
        "body", "--id-field", "doc", "--rows-per-part", "8", "--dtype", "float32",
        "--num-threads", "2", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, start_new_session=True)
    manifest = output / "_manifest.json"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if manifest.exists() and len(_parts(manifest)) >= 10:
                break
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()
    state = json.loads(manifest.read_text())
    num_done = len(state["parts"])
    assert state["num_rows"] is None and 10 <= num_done < 188  # killed mid-run

    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"({num_done} done earlier)" in done.stdout  # finished parts are not redone
    assert not list(output.glob(".*.tmp"))
    ids, embeddings, num_tokens = read_output(output)
    ref_ids, ref_embeddings, ref_tokens = read_output(reference)
    assert ids == ref_ids == [r["doc"] for r in rows]  # none lost, none duplicated
    assert num_tokens == ref_tokens
    assert np.abs(embeddings - ref_embeddings).max() <= 1e-6


def _parts(manifest: Path) -> dict:
    try:
        return json.loads(manifest.read_text())["parts"]
    except (OSError, ValueError):
        return {}
