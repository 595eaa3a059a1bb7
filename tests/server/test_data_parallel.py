"""Data-parallel serving: ``cenote serve --data-parallel-size 2`` (two engine-core processes, one
core each) answers as one core does under concurrent load, and one core dying fails only its own
in-flight requests while the other keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
import torch

from tests.server_fixture import ServerProcess

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="data parallel needs two CPU cores"
)

TEXTS = [f"sentence number {i} about rivers, {'and mountains ' * (i % 7)}" for i in range(48)]


@pytest.fixture(scope="module")
def dp_server():
    server = ServerProcess("--dtype", "float32", "--data-parallel-size", "2")
    try:
        yield server
    finally:
        server.stop()


async def _embed_all(url: str, texts: list[str], concurrency: int) -> list[list[float] | int]:
    """One request per text, ``concurrency`` at a time: the embedding, or the error status."""
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(text: str) -> list[float] | int:
            async with semaphore:
                response = await client.post("/v1/embeddings", json={"input": text})
                if response.status_code != 200:
                    return response.status_code
                return response.json()["data"][0]["embedding"]

        return await asyncio.gather(*(one(t) for t in texts))


def test_two_cores_answer_as_the_offline_engine_does(dp_server, llm_fp32):
    assert len(dp_server.engine_pids()) == 2
    got = torch.tensor(asyncio.run(_embed_all(dp_server.url, TEXTS, 16)))
    expected = torch.stack([o.outputs.data for o in llm_fp32.embed(TEXTS)])
    assert (got - expected).abs().max() <= 1e-5
    health = httpx.get(f"{dp_server.url}/health").json()
    assert health["status"] == "ok"


@pytest.mark.stops_module_server
def test_one_core_dying_fails_only_its_requests(dp_server, llm_fp32):
    """Runs last in the module (conftest): it kills a core of the shared server."""
    expected = {t: o.outputs.data for t, o in zip(TEXTS, llm_fp32.embed(TEXTS), strict=True)}

    async def run() -> list[list[float] | int]:
        before = dp_server.num_steps()
        load = asyncio.create_task(_embed_all(dp_server.url, TEXTS * 4, 8))
        await asyncio.to_thread(dp_server.wait_for_steps, before)  # the load is running
        os.kill(dp_server.engine_pids()[1], signal.SIGKILL)
        return await load

    results = asyncio.run(run())
    # every answer the front reported as a success is right; failures are 503 (engine gone)
    ok = [r for r in results if not isinstance(r, int)]
    print(f"{len(ok)} answered, {len(results) - len(ok)} failed with the core")
    assert {r for r in results if isinstance(r, int)} <= {503}
    assert ok, "the surviving core answered nothing"
    for text, result in zip(TEXTS * 4, results, strict=True):
        if not isinstance(result, int):
            assert (torch.tensor(result) - expected[text]).abs().max() <= 1e-5
    health = httpx.get(f"{dp_server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert "1" in health.json()["dead_engines"]
    # the surviving core serves every new request
    after = asyncio.run(_embed_all(dp_server.url, TEXTS, 8))
    assert all(not isinstance(r, int) for r in after)


# ---- routing, without processes ---------------------------------------------------------------


def test_routing_prefers_the_core_holding_the_prefix(llm_fp32):
    from cenote.engine.dp_client import DataParallelEngineClient, split_cores

    configs = split_cores(llm_fp32.config, 2)
    assert [c.num_threads for c in configs] == [1, 1]
    assert configs[0].cpu_ids != configs[1].cpu_ids
    client = DataParallelEngineClient(llm_fp32.config, llm_fp32.tokenizer, 2)
    first, second = client.cores

    def load(core, count: int) -> None:
        core.output_processor.states = {f"busy-{i}": None for i in range(count)}

    prompt_a, prompt_b = list(range(100, 120)), list(range(200, 220))
    assert client._pick(client._prefix_key(prompt_a)) is first  # both idle: the first
    load(first, 3)
    assert client._pick(client._prefix_key(prompt_a)) is first  # holds the prefix, a bit busier
    assert client._pick(client._prefix_key(prompt_b)) is second  # new prefix: least loaded
    assert client._pick(None) is second
    load(first, 3 + llm_fp32.config.scheduler.max_num_seqs)
    assert client._pick(client._prefix_key(prompt_a)) is second  # far busier: balance wins
    assert client._pick(client._prefix_key(prompt_a)) is second  # and the route moved
    second.dead_reason = "killed"
    assert client._pick(client._prefix_key(prompt_b)) is first
    assert client._prefix_key(list(range(5))) is None  # no full block: no affinity
