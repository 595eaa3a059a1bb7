"""cenote on a real two-node Ray cluster started here (``ray start --head`` + a second
``ray start --address`` node on this machine, 1 CPU each, both killed at the end): the corpus
job through Ray Data equals the single-process job, and ``cenote.ray`` classes in
``map_batches(..., concurrency=2)`` equal the offline API for score / classify / generate."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray
from factories.corpus import LONG_TEXT, corpus, embed_job, read_output, write_jsonl
from server_fixture import free_port

from cenote.apps.corpus.readers import open_source

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
RAY_BIN = Path(sys.executable).with_name("ray")


def _node_options() -> list[str]:
    """One CPU, a small object store and free ports, so the test cluster fits beside others."""
    ports = [free_port() for _ in range(5)]
    first_worker_port = 20000 + ports[0] % 30000
    return [
        "--num-cpus", "1", "--object-store-memory", str(200 << 20), "--disable-usage-stats",
        "--node-ip-address", "127.0.0.1", "--node-manager-port", str(ports[0]),
        "--object-manager-port", str(ports[1]), "--dashboard-agent-listen-port", str(ports[2]),
        "--metrics-export-port", str(ports[3]), "--runtime-env-agent-port", str(ports[4]),
        "--min-worker-port", str(first_worker_port),
        "--max-worker-port", str(first_worker_port + 40), "--block",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Iterator[str]:
    """The address of a head node and a second node, started here and always killed."""
    os.environ.update(RAY_ENV)
    env = {**os.environ, **RAY_ENV}
    logs = tmp_path_factory.mktemp("ray-logs")
    port = free_port()
    address = f"127.0.0.1:{port}"
    head_command = [
        str(RAY_BIN), "start", "--head", "--port", str(port), "--include-dashboard", "false",
        "--temp-dir", str(tmp_path_factory.mktemp("ray")), *_node_options(),
    ]  # fmt: skip
    worker_command = [str(RAY_BIN), "start", "--address", address, *_node_options()]
    nodes: list[subprocess.Popen] = []
    try:
        for command, log in ((head_command, "head.log"), (worker_command, "worker.log")):
            nodes.append(
                subprocess.Popen(
                    command,
                    env=env,
                    stdout=open(logs / log, "wb"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            )
            if command is head_command:
                _wait_for_port(port, nodes[0], logs / log)
        ray.init(address=address, log_to_driver=False)
        deadline = time.monotonic() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.monotonic() < deadline, (logs / "worker.log").read_text()
            time.sleep(0.2)
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        yield address
    finally:
        ray.shutdown()
        for node in nodes:  # the node processes, their raylet and GCS; workers follow them
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def _wait_for_port(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(log.read_text())


def _cenote(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **RAY_ENV}
    return subprocess.run(
        [sys.executable, "-m", "cenote", *args], env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_corpus_job_on_ray_equals_single_process(ray_cluster, llm_fp32, tmp_path):
    rows = corpus(300)
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    embed_job(llm_fp32, open_source(path, "body", "doc"), tmp_path / "local", rows_per_part=64)
    done = _cenote(
        "embed", str(path), "-o", str(tmp_path / "ray"), "--text-field", "body", "--id-field",
        "doc", "--rows-per-part", "64", "--dtype", "float32", "--no-progress",
        "--ray", ray_cluster, "--ray-workers", "2", "--ray-cpus-per-worker", "1",
        "--ray-batch-size", "32",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "300 rows in 5 parts" in done.stdout
    ids, embeddings, num_tokens = read_output(tmp_path / "ray")
    ref_ids, ref_embeddings, ref_tokens = read_output(tmp_path / "local")
    assert ids == ref_ids == [r["doc"] for r in rows]
    assert num_tokens == ref_tokens
    assert np.abs(embeddings - ref_embeddings).max() <= 1e-6
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == sorted(
        p.name for p in (tmp_path / "local").iterdir()
    )


def test_score_classify_generate_in_map_batches(ray_cluster, llm_fp32, tmp_path):
    from factories.decoders import make_decoder
    from factories.encoders import make_encoder_classifier
    from factories.generation import make_llm

    import cenote.ray
    from cenote.sampling_params import SamplingParams

    queries = [f"query {i} about cats" for i in range(12)]
    documents = [f"document {i} about {'cats' if i % 2 else 'dogs'}" for i in range(12)]
    make_encoder_classifier(tmp_path / "classifier", "bert", "ForSequenceClassification")
    make_decoder(tmp_path / "llama", "llama")
    prompts = [" ".join(f"w{3 + (i * 7 + j) % 200}" for j in range(5)) for i in range(12)]
    dataset = ray.data.from_items(
        [{"text_1": q, "text_2": d, "prompt": p} for q, d, p in zip(queries, documents, prompts, strict=True)]
    )  # fmt: skip
    common = {"concurrency": 2, "num_cpus": 1, "batch_size": 4}

    scored = dataset.map_batches(
        cenote.ray.Scorer, fn_constructor_kwargs={"dtype": "float32"}, **common
    ).take_all()
    expected = [s.outputs.score for s in llm_fp32.score(queries, documents, use_tqdm=False)]
    assert [r["text_1"] for r in scored] == queries  # order kept
    assert np.abs(np.array([r["score"] for r in scored]) - expected).max() <= 1e-6

    classified = dataset.map_batches(
        cenote.ray.Classifier, fn_constructor_kwargs={
            "model": str(tmp_path / "classifier"), "dtype": "float32", "text_column": "text_1",
            "drop_columns": ("text_2", "prompt"),
        }, **common,
    ).take_all()  # fmt: skip
    reference = make_llm(tmp_path / "classifier").classify(queries, use_tqdm=False)
    assert set(classified[0]) == {"text_1", "probs", "label"}
    for row, ref in zip(classified, reference, strict=True):
        assert np.abs(row["probs"] - ref.outputs.data.numpy()).max() <= 1e-6
        assert row["label"] == ref.outputs.label

    greedy = {"temperature": 0, "max_tokens": 6}
    generated = dataset.map_batches(
        cenote.ray.Generator, fn_constructor_kwargs={
            "model": str(tmp_path / "llama"), "dtype": "float32", "sampling_params": greedy,
        }, **common,
    ).take_all()  # fmt: skip
    reference = make_llm(tmp_path / "llama").generate(
        prompts, SamplingParams(**greedy), use_tqdm=False
    )
    assert [r["generated_text"] for r in generated] == [o.outputs[0].text for o in reference]
    assert [r["num_generated_tokens"] for r in generated] == [
        len(o.outputs[0].token_ids) for o in reference
    ]


def test_a_passage_refused_on_a_worker_names_its_line(ray_cluster, tmp_path):
    rows = corpus(40)
    rows[33]["body"] = LONG_TEXT
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    done = _cenote(
        "embed", str(path), "-o", str(tmp_path / "out"), "--text-field", "body",
        "--rows-per-part", "16", "--no-progress", "--ray", ray_cluster, "--ray-workers", "2",
        "--ray-cpus-per-worker", "1",
    )  # fmt: skip
    assert done.returncode == 1
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"cenote embed: error: {path} line 34: the passage has 4")
    assert "--truncate" in last_line


def test_an_address_that_does_not_answer_is_named(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", corpus(3))
    address = f"127.0.0.1:{free_port()}"
    done = _cenote("embed", str(path), "-o", str(tmp_path / "out"), "--ray", address, timeout=60)
    assert done.returncode == 1
    assert f"the Ray cluster at '{address}' does not answer" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_data_parallel_serving_with_ray_actors(ray_cluster, llm_fp32):
    """``cenote serve --data-parallel-size 2 --distributed-executor ray``: the engine cores are
    Ray actors on the cluster's two nodes, zmq over TCP; answers equal the offline engine."""
    import asyncio

    import httpx
    import torch
    from server_fixture import ServerProcess

    texts = [f"passage {i} on rivers and {'hills ' * (i % 5)}" for i in range(24)]
    server = ServerProcess(
        "--dtype", "float32", "--num-threads", "1", "--data-parallel-size", "2",
        "--distributed-executor", "ray", "--ray-address", ray_cluster, timeout_s=180,
    )  # fmt: skip
    try:

        async def embed_all() -> list[list[float]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

                async def one(text: str) -> list[float]:
                    response = await client.post("/v1/embeddings", json={"input": text})
                    assert response.status_code == 200, response.text
                    return response.json()["data"][0]["embedding"]

                return await asyncio.gather(*(one(t) for t in texts))

        got = torch.tensor(asyncio.run(embed_all()))
        expected = torch.stack([o.outputs.data for o in llm_fp32.embed(texts)])
        assert (got - expected).abs().max() <= 1e-5
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        assert server.stop() == 0, server.log()[-3000:]
        assert "Traceback" not in server.log()
    finally:
        server.stop()


def test_the_core_watcher_does_not_call_into_a_closed_loop_after_stop(monkeypatch):
    # CI once failed with "RuntimeError: Event loop is closed" in cenote-ray-core-watch: the
    # actor ended because the server shut it down, the server's loop closed, and only then did
    # the watcher thread wake and schedule its callback. A fake ``ray`` module holds the
    # watcher until the loop is closed, so the race is hit every time.
    import asyncio
    import threading
    import types

    from cenote.engine.core_launcher import RayLauncher

    actor_ended = threading.Event()

    def wait(refs, timeout=None):
        if timeout is None:
            actor_ended.wait()
        return refs, []

    fake = types.SimpleNamespace(
        is_initialized=lambda: True,
        util=types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1"),
        wait=wait,
        get=lambda ref: None,
        kill=lambda actor: None,
    )
    monkeypatch.setitem(sys.modules, "ray", fake)
    launcher = RayLauncher(None)
    launcher._done = object()  # as start() leaves it: the ObjectRef of the core's loop

    failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    called: list[str] = []

    async def serve_then_stop() -> None:
        launcher.on_exit(asyncio.get_running_loop(), called.append)
        await launcher.stop(timeout=1.0)

    asyncio.run(serve_then_stop())  # closes the loop
    watchers = [t for t in threading.enumerate() if t.name == "cenote-ray-core-watch"]
    actor_ended.set()
    for t in watchers:
        t.join(timeout=10)
    assert watchers and not any(t.is_alive() for t in watchers)
    assert failures == [] and called == []
