"""The OpenAI Batch API online (``cenote serve --batch-dir``), through the official ``openai``
client: files.create / batches.create / batches.retrieve / files.content on the default MiniLM
server, each result equal to the /v1/embeddings answer; bad input refused with its status;
cancel; and a kill -9 of the server mid-job, after which a restart finishes every line exactly
once without running again the ones that had finished.

One server for the module (``batch_server``): the kill test, last, replaces it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest

from cenote.server.batch_jobs import BATCH_PRIORITY
from cenote.server.errors import APIError
from cenote.server.uploads import read_upload
from tests.conftest import NUM_THREADS
from tests.server_fixture import ServerProcess, wait_until

MAX_FILE_BYTES = 1 << 20
MAX_LINES = 300
API_KEY = "batch-key"
ATOL = 1e-5  # batch invariance, fp32 (DESIGN.md)


class BatchServer:
    """The module's server; ``restart`` starts a new one on the same --batch-dir."""

    def __init__(self, batch_dir: Path) -> None:
        self.batch_dir = batch_dir
        self.server = self._start()

    def _start(self) -> ServerProcess:
        return ServerProcess(
            "--dtype", "float32", "--num-threads", str(NUM_THREADS), "--batch-dir",
            str(self.batch_dir), "--max-batch-file-bytes", str(MAX_FILE_BYTES),
            "--max-batch-lines", str(MAX_LINES), "--batch-concurrency", "2",
            api_key=API_KEY,  # the lines' in-process calls carry it too
        )  # fmt: skip

    def restart(self) -> None:
        self.server = self._start()

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory: pytest.TempPathFactory):
    holder = BatchServer(tmp_path_factory.mktemp("batches"))
    try:
        yield holder
    finally:
        holder.server.stop()


def _line(custom_id: str, body: dict, url: str = "/v1/embeddings") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _upload(client: openai.OpenAI, lines: list[str]):
    return client.files.create(
        file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch"
    )


def _wait(client: openai.OpenAI, batch_id: str, timeout_s: float = 60.0):
    ended = ("completed", "failed", "cancelled", "expired")
    batch = client.batches.retrieve(batch_id)
    deadline = time.monotonic() + timeout_s
    while batch.status not in ended:
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout_s} s"
        time.sleep(0.05)
        batch = client.batches.retrieve(batch_id)
    return batch


def _jsonl(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _embedding(url: str, body: dict, api_key: str | None = API_KEY) -> list[list[float]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    answer = httpx.post(f"{url}/v1/embeddings", json=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    return [row["embedding"] for row in answer.json()["data"]]


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and max(abs(p - q) for p, q in zip(x, y, strict=True)) <= ATOL
        for x, y in zip(a, b, strict=True)
    )


def test_batch_results_equal_the_route_and_bad_lines_fail_alone(batch_server):
    client = batch_server.client
    bodies = {f"ok-{i}": {"input": [f"the {i}th sentence of the batch", "a shared one"]}
              for i in range(4)}  # fmt: skip
    bodies["ok-b64"] = {"input": "encoded as base64", "encoding_format": "base64"}
    lines = [_line(custom_id, body) for custom_id, body in bodies.items()]
    lines[2:2] = [
        '{"custom_id": "broken", "method": "POST", "url": "/v1/embeddings", "body": {',
        _line("bad-body", {"input": 5}),
        _line("other-url", {"input": "x"}, url="/v1/completions"),
        _line("stream", {"input": "x", "stream": True}),
    ]
    uploaded = _upload(client, lines)
    assert (uploaded.object, uploaded.purpose, uploaded.status) == ("file", "batch", "processed")
    assert client.files.retrieve(uploaded.id).bytes == uploaded.bytes
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h",
        metadata={"job": "nightly"},
    )  # fmt: skip
    assert batch.status == "validating" and batch.request_counts.total == len(lines)

    batch = _wait(client, batch.id)

    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 4)
    assert batch.metadata == {"job": "nightly"} and batch.endpoint == "/v1/embeddings"
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    outputs = _jsonl(client, batch.output_file_id)
    assert [o["custom_id"] for o in outputs] == list(bodies)  # input order
    for output in outputs:
        assert output["error"] is None and output["response"]["status_code"] == 200
        body = bodies[output["custom_id"]]
        got = output["response"]["body"]
        assert got["object"] == "list" and got["usage"]["prompt_tokens"] > 0
        if body.get("encoding_format") == "base64":
            assert isinstance(got["data"][0]["embedding"], str)
            continue
        assert _close(
            [row["embedding"] for row in got["data"]], _embedding(batch_server.server.url, body)
        )
    errors = {e["custom_id"]: e for e in _jsonl(client, batch.error_file_id)}
    assert set(errors) == {None, "bad-body", "other-url", "stream"}  # broken JSON: no custom_id
    assert "line 3 is not valid JSON" in errors[None]["error"]["message"]
    assert errors["bad-body"]["response"]["status_code"] in (400, 422)
    assert "line 4" in errors["bad-body"]["error"]["message"]
    assert "is not the batch's endpoint" in errors["other-url"]["error"]["message"]
    assert "stream" in errors["stream"]["error"]["message"]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list(limit=100)]
    with pytest.raises(openai.ConflictError, match="completed"):
        client.batches.cancel(batch.id)


def test_score_lines_equal_the_score_route(batch_server):
    """Another endpoint: bi-encoder scores (cosine of MiniLM embeddings) through /v1/score."""
    client, url = batch_server.client, batch_server.server.url
    bodies = [{"text_1": "a cat", "text_2": ["a kitten", "a truck"]},
              {"text_1": ["rivers", "lakes"], "text_2": ["streams", "ponds"]}]  # fmt: skip
    lines = [_line(f"s{i}", body, url="/v1/score") for i, body in enumerate(bodies)]
    batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                  endpoint="/v1/score", completion_window="24h")  # fmt: skip
    batch = _wait(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    for output, body in zip(_jsonl(client, batch.output_file_id), bodies, strict=True):
        direct = httpx.post(f"{url}/v1/score", json=body, headers=batch_server.server.headers)
        want = [row["score"] for row in direct.json()["data"]]
        got = [row["score"] for row in output["response"]["body"]["data"]]
        assert len(got) == len(want) and all(
            abs(g - w) <= ATOL for g, w in zip(got, want, strict=True)
        )


def test_bad_input_is_refused_with_its_status(batch_server):
    client = batch_server.client
    good = _upload(client, [_line("a", {"input": "x"})])
    with pytest.raises(openai.NotFoundError, match="no file with id"):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/embeddings",
                              completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="endpoint '/v1/images' is not served"):
        client.batches.create(input_file_id=good.id, endpoint="/v1/images",  # type: ignore[arg-type]
                              completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="completion_window must be '24h'"):
        client.batches.create(input_file_id=good.id, endpoint="/v1/embeddings",
                              completion_window="1h")  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=("x.jsonl", b'{"a": 1}\n'), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="the file is empty"):
        client.files.create(file=("x.jsonl", b""), purpose="batch")
    with pytest.raises(openai.APIStatusError, match=f"limit of {MAX_FILE_BYTES} bytes") as info:
        client.files.create(file=("x.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert info.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match=f"more than {MAX_LINES} lines"):
        client.files.create(file=("x.jsonl", b"{}\n" * (MAX_LINES + 1)), purpose="batch")
    with pytest.raises(openai.NotFoundError, match="no batch with id"):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError, match="no file with id"):
        client.files.content("file-nope")
    output = client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    assert client.files.delete(output.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(output.id)
    # two lines with one custom_id: the whole batch fails, naming them
    repeated = _upload(client, [_line("same", {"input": "x"}), _line("same", {"input": "y"})])
    batch = client.batches.create(input_file_id=repeated.id, endpoint="/v1/embeddings",
                                  completion_window="24h")  # fmt: skip
    batch = _wait(client, batch.id)
    assert batch.status == "failed" and batch.errors.data[0].code == "duplicate_custom_id"
    assert "'same' on line 1 and line 2" in batch.errors.data[0].message


def test_the_api_is_a_clear_404_without_batch_dir(default_server):
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="--batch-dir"):
        client.batches.retrieve("batch_x")
    paths = httpx.get(f"{default_server.url}/openapi.json").json()["paths"]
    assert "/v1/batches" not in paths  # documented only where it is on


def test_cancel_keeps_the_finished_lines(batch_server):
    client = batch_server.client
    text = " ".join(["a sentence long enough to take the engine a moment"] * 8)
    lines = [_line(f"r{i}", {"input": [text] * 8}) for i in range(120)]
    batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                  endpoint="/v1/embeddings", completion_window="24h")  # fmt: skip
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed > 0, "a line")

    cancelling = client.batches.cancel(batch.id)

    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    batch = _wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    done = batch.request_counts.completed
    assert 0 < done < len(lines) and batch.request_counts.failed == 0
    ids = [o["custom_id"] for o in _jsonl(client, batch.output_file_id)]
    assert ids == [f"r{i}" for i in sorted(int(c[1:]) for c in ids)] and len(ids) == done
    assert batch.error_file_id is None
    # the engine is free again and answers interactive requests
    assert len(_embedding(batch_server.server.url, {"input": "after the cancel"})) == 1


def test_the_routes_are_documented_where_the_api_is_on(batch_server):
    spec = httpx.get(
        f"{batch_server.server.url}/openapi.json", headers=batch_server.server.headers
    ).json()
    routes = [(path, method, operation) for path, operations in spec["paths"].items()
              for method, operation in operations.items() if path.startswith(("/v1/files", "/v1/batches"))]  # fmt: skip
    assert len(routes) == 9
    for path, method, operation in routes:
        responses = operation["responses"]
        assert responses["200"].get("content") and "401" in responses, (method, path)
        if method == "post":
            assert {"400", "401", "413", "503"} <= set(responses), (method, path)
    upload = spec["paths"]["/v1/files"]["post"]["requestBody"]["content"]
    assert list(upload) == ["multipart/form-data"]


def test_priority_policy_is_on_with_batch_dir(batch_server):
    assert "engines schedule by priority" in batch_server.server.log()
    assert BATCH_PRIORITY > 0  # interactive requests default to 0 and run first


def test_kill_9_mid_job_then_restart_finishes_every_line_once(batch_server):
    client = batch_server.client
    text = " ".join(["another sentence for the engine to embed"] * 8)
    num_lines = 80
    lines = [_line(f"k{i}", {"input": [f"{i} {text}"] * 6}) for i in range(num_lines)]
    batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                  endpoint="/v1/embeddings", completion_window="24h")  # fmt: skip
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3, "lines")

    os.killpg(batch_server.server.process.pid, signal.SIGKILL)  # front and engine core
    batch_server.server.process.wait()
    with sqlite3.connect(batch_server.batch_dir / "batches.sqlite3") as db:
        before = dict(db.execute("SELECT line_number, data FROM results WHERE batch_id = ?",
                                 (batch.id,)).fetchall())  # fmt: skip
    assert 3 <= len(before) < num_lines, "the kill came after the job had finished"
    batch_server.restart()
    client = batch_server.client

    batch = _wait(client, batch.id)

    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed) == (num_lines, num_lines)
    outputs = client.files.content(batch.output_file_id).text.splitlines()
    assert [json.loads(o)["custom_id"] for o in outputs] == [f"k{i}" for i in range(num_lines)]
    for number, data in before.items():  # finished before the kill: kept, not run again
        assert outputs[number - 1] == bytes(data).decode()
    last = json.loads(outputs[-1])["response"]["body"]
    want = _embedding(batch_server.server.url, json.loads(lines[-1])["body"])
    assert _close([row["embedding"] for row in last["data"]], want)


# ---- the upload reader, without a server ------------------------------------------------------


def test_multipart_upload_is_read_whatever_the_chunk_sizes(tmp_path):
    content = b'{"custom_id": "a"}\r\n--not-the-boundary\n{"b": 2}'
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n" + content + b"\r\n--XyZ--\r\n")  # fmt: skip
    for size in (1, 2, 3, 7, 64, len(body)):

        async def chunks(size=size):
            for start in range(0, len(body), size):
                yield body[start : start + size]

        path = tmp_path / f"upload-{size}"
        upload = asyncio.run(read_upload(chunks(), b"XyZ", path, 1 << 20, 10))
        assert path.read_bytes() == content, size
        assert upload.fields == {"purpose": "batch"} and upload.filename == "in.jsonl"
        assert (upload.num_bytes, upload.num_lines) == (len(content), 3)
    with pytest.raises(APIError, match="ends before its closing boundary"):

        async def cut():
            yield body[:-12]

        asyncio.run(read_upload(cut(), b"XyZ", tmp_path / "cut", 1 << 20, 10))


# ---- the job runner in-process, over a stand-in app --------------------------------------------


def _stand_in_app(answers: list[int]):
    """An ASGI app answering each POST with the next status of ``answers`` (then 200), echoing
    the body it got."""

    async def app(scope, receive, send):
        body = (await receive())["body"]
        status = answers.pop(0) if answers else 200
        payload = body if status == 200 else b'{"error": {"message": "busy", "type": "rate"}}'
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": payload})

    return app


def _run_jobs(tmp_path: Path, answers: list[int], expired: bool) -> tuple[dict, list[dict]]:
    from cenote.server.batch_jobs import BatchJobs
    from cenote.server.batch_store import BatchStore

    store = BatchStore(tmp_path)
    upload = store.new_upload_path()
    upload.write_text("\n".join(_line(f"r{i}", {"input": f"text {i}"}) for i in range(3)) + "\n")
    stored = store.add_file(upload, "batch", "in.jsonl", upload.stat().st_size, 3)
    batch_id = store.add_batch("/v1/embeddings", stored, None)
    if expired:
        with store.db:
            store.db.execute("UPDATE batches SET expires_at = 0 WHERE id = ?", (batch_id,))

    async def run() -> None:
        jobs = BatchJobs(store, _stand_in_app(answers), 1, 1 << 20, api_key=None)
        jobs.start()
        while (await jobs.db(store.get_batch, batch_id)).status not in ("completed", "expired"):
            await asyncio.sleep(0.01)
        await jobs.stop()

    asyncio.run(run())
    store = BatchStore(tmp_path)
    batch = store.to_openai(batch_id)
    file_id = batch["output_file_id"]
    lines = [] if file_id is None else store.file_path(file_id).read_text().splitlines()
    return batch, [json.loads(line) for line in lines]


def test_a_line_answered_429_or_503_is_sent_again(tmp_path):
    batch, outputs = _run_jobs(tmp_path, [429, 503], expired=False)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 3
    bodies = [o["response"]["body"] for o in outputs]
    assert [b["input"] for b in bodies] == ["text 0", "text 1", "text 2"]
    assert {b["priority"] for b in bodies} == {BATCH_PRIORITY}  # the routes get batch priority


def test_a_batch_past_its_window_expires_without_running(tmp_path):
    batch, outputs = _run_jobs(tmp_path, [], expired=True)
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0} and not outputs


def test_one_server_per_batch_dir(tmp_path):
    from cenote.server.batch_store import BatchStore

    store = BatchStore(tmp_path)
    (store.files_dir / ".upload-cut-short").write_bytes(b"half a file")
    with pytest.raises(ValueError, match="in use by another cenote server"):
        BatchStore(tmp_path)
    store.close()
    BatchStore(tmp_path).close()  # free again; the leftover upload is gone
    assert not list(store.files_dir.iterdir())
