"""Per-phase timings: the engine core's queue and inference durations on the outputs
(``output.metrics``), and text-embeddings-inference's timing headers on server responses
(``cenote/server/timing.py``). No timing is asserted beyond what must hold: non-negative,
a waiting request waited, and the phases fit in the total."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import NUM_THREADS
from factories.decoders import make_decoder
from factories.device import engine_options
from factories.generation import make_llm, random_prompts, token_prompts

from cenote import LLM, SamplingParams

_TIMING_HEADERS = (
    "x-compute-time", "x-compute-characters", "x-compute-tokens", "x-total-time",
    "x-tokenization-time", "x-queue-time", "x-inference-time",
)  # fmt: skip


def _durations(metrics: dict[str, float]) -> tuple[float, float]:
    return metrics["queue_time"], metrics["inference_time"]


def test_a_request_that_waits_behind_another_has_queue_time(minilm_path: Path) -> None:
    """One sequence per step: the second input is scheduled only after the first finished."""
    options = {**engine_options(), "num_threads": NUM_THREADS, "max_num_seqs": 1}
    llm = LLM(str(minilm_path), dtype="float32", **options)
    first, second = llm.embed(["the first input", "the second input waits"])
    for output in (first, second):
        queue, inference = _durations(output.metrics)
        assert queue >= 0.0 and inference > 0.0
    _, first_inference = _durations(first.metrics)
    second_queue, _ = _durations(second.metrics)
    assert second_queue > 0.0
    # the second waited at least while the first ran (one monotonic clock, in one process)
    assert second_queue >= first_inference


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = tmp_path_factory.mktemp("timings_llama")
    make_decoder(folder, "llama")
    return make_llm(folder)


def test_generation_outputs_carry_durations_once_finished(tiny_llama: LLM) -> None:
    """n completions: the shortest wait, and the longest time one spent in the core."""
    params = SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3, ignore_eos=True)
    prompts = token_prompts(random_prompts([5, 7]))
    for output in tiny_llama.generate(prompts, params):
        assert output.finished
        queue, inference = _durations(output.metrics)
        assert queue >= 0.0 and inference > 0.0
        assert "first_token_time" in output.metrics


# ---- the server's headers --------------------------------------------------------------------


def _timings(response: httpx.Response) -> dict[str, int]:
    assert response.status_code == 200, response.text
    assert response.headers["x-compute-type"] == "cpu"
    values = {name: int(response.headers[name]) for name in _TIMING_HEADERS}  # whole ms
    assert all(value >= 0 for value in values.values()), values
    assert values["x-compute-time"] == values["x-total-time"]
    # each phase truncated to whole ms: their sum is at most the truncated total + 2 ms
    phases = values["x-tokenization-time"] + values["x-queue-time"] + values["x-inference-time"]
    assert phases <= values["x-total-time"] + 2, values
    return values


def test_openai_embeddings_have_timing_headers(default_server) -> None:
    texts = ["timing headers", "on every pooling response, like TEI's"]
    response = httpx.post(f"{default_server.url}/v1/embeddings", json={"input": texts}, timeout=60)
    values = _timings(response)
    assert values["x-compute-tokens"] == response.json()["usage"]["prompt_tokens"]
    assert values["x-compute-characters"] == sum(len(text) for text in texts)


def test_tei_embed_has_timing_headers(default_server) -> None:
    response = httpx.post(
        f"{default_server.url}/embed", json={"inputs": "a TEI client reads these"}, timeout=60
    )
    values = _timings(response)
    assert values["x-compute-characters"] == len("a TEI client reads these")
    assert values["x-compute-tokens"] > 0


def test_routes_outside_the_engine_have_no_timing_headers(default_server) -> None:
    response = httpx.get(f"{default_server.url}/health", timeout=60)
    assert response.status_code == 200
    assert "x-total-time" not in response.headers
    error = httpx.post(f"{default_server.url}/v1/embeddings", json={"input": []}, timeout=60)
    assert error.status_code == 400
    assert "x-total-time" not in error.headers


def test_chat_completion_has_timing_headers_and_a_stream_has_none(smollm2_server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        "temperature": 0.0,
    }
    url = f"{smollm2_server.url}/v1/chat/completions"
    response = httpx.post(url, json=body, timeout=120)
    values = _timings(response)
    assert values["x-compute-tokens"] == response.json()["usage"]["prompt_tokens"]
    assert values["x-compute-characters"] > 0  # the rendered template
    # a stream's headers go out before any work is done
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as streamed:
        assert streamed.status_code == 200
        assert "x-total-time" not in streamed.headers
        streamed.read()
