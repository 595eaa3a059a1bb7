"""Jina v3 (``XLMRobertaLoRA``, jina-embeddings-v3) vs transformers' native
``JinaEmbeddingsV3Model``, tiny random models, fp32.

The folder under test is in the remote code's layout (tests/factories/jina_v3.py: fused
``mixer.Wqkv``, parametrized weights, task factors stacked by task). The references are
transformers' own implementation reading the same tensors through its conversion mapping: the
base weights for the trunk, and for each task the weights with that task's factors merged in
plain torch, as the remote code computes an adapted weight.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_THREADS
from factories.jina_v3 import INSTRUCTIONS, TASKS, reference_model, save_jina_v3
from factories.texts import random_prompts

from cenote import LLM, PoolingParams
from cenote.errors import InvalidInputError

ATOL = 1e-4  # DESIGN.md §3: hidden states vs transformers, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs the reference, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
LENGTHS = [1, 3, 17, 60]
TEXTS = ["the cat sat", "a dog", "the mat . the cat , the dog !", "query document"]


@pytest.fixture(scope="module")
def jina(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LLM]:
    folder = save_jina_v3(tmp_path_factory.mktemp("jina-v3") / "model", seed=5)
    return folder, LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)


def _reference(folder: Path, tmp: Path, task: str | None) -> torch.nn.Module:
    return reference_model(folder, tmp / f"ref-{task}", task)


def _token_embed(llm: LLM, prompts: list[list[int]], task: str | None) -> list[torch.Tensor]:
    outputs = llm.encode(
        [{"prompt_token_ids": p} for p in prompts],
        PoolingParams(normalize=False, lora_task=task),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    return [out.outputs.data.float() for out in outputs]


@pytest.mark.parametrize("task", [None, "retrieval.query", "text-matching"])
def test_hidden_states_match_transformers(jina, tmp_path: Path, task: str | None) -> None:
    """The trunk (no task) and the trunk under a task's adapter, row for row."""
    folder, llm = jina
    reference = _reference(folder, tmp_path, task)
    prompts = random_prompts(LENGTHS, seed=2)
    torch.set_num_threads(NUM_THREADS)
    for prompt, ours in zip(prompts, _token_embed(llm, prompts, task), strict=True):
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        assert ours.shape == expected.shape == (len(prompt), 32)
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def _reference_embeddings(reference: torch.nn.Module, llm: LLM, texts: list[str]) -> torch.Tensor:
    """Mean-pooled, L2-normalized, as the folder's sentence-transformers modules say."""
    tokenizer = llm.tokenizer
    rows = []
    for text in texts:
        ids = tokenizer.encode(text).ids
        with torch.no_grad():
            hidden = reference(input_ids=torch.tensor([ids])).last_hidden_state[0]
        rows.append(F.normalize(hidden.mean(0), dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("task", TASKS)
def test_task_embeddings_match_merged_reference(jina, tmp_path: Path, task: str) -> None:
    """Each task: its adapter and its instruction before every text (the remote code's
    ``encode(task=)``), cosine vs the reference with that adapter merged."""
    folder, llm = jina
    reference = _reference(folder, tmp_path, task)
    ours = llm.embed(TEXTS, PoolingParams(lora_task=task), use_tqdm=False)
    expected = _reference_embeddings(reference, llm, [INSTRUCTIONS[task] + t for t in TEXTS])
    for out, want in zip(ours, expected, strict=True):
        got = torch.tensor(out.outputs.embedding)
        assert F.cosine_similarity(got, want, dim=0) >= MIN_COSINE_FP32


def test_tasks_differ_from_each_other_and_the_base(jina) -> None:
    """The adapters are applied: every task (and no task) gives its own embedding."""
    _, llm = jina
    params = [PoolingParams(lora_task=t, prompt="") for t in TASKS] + [PoolingParams()]
    vectors = [llm.embed(["the cat sat"], p, use_tqdm=False)[0].outputs.embedding for p in params]
    for i in range(len(vectors)):
        for j in range(i):
            assert max(abs(a - b) for a, b in zip(vectors[i], vectors[j], strict=True)) > 1e-3


def test_batch_mixing_tasks_equals_each_alone(jina) -> None:
    """One step holding rows of every task and of the base equals each request run alone."""
    _, llm = jina
    tasks: list[str | None] = [*TASKS, None, TASKS[0], None]
    texts = [TEXTS[i % len(TEXTS)] for i in range(len(tasks))]
    params = [PoolingParams(lora_task=t) for t in tasks]
    mixed = llm.embed(texts, params, use_tqdm=False)
    for text, p, out in zip(texts, params, mixed, strict=True):
        alone = llm.embed([text], p, use_tqdm=False)[0]
        torch.testing.assert_close(
            torch.tensor(out.outputs.embedding),
            torch.tensor(alone.outputs.embedding),
            atol=BATCH_ATOL,
            rtol=0,
        )


def test_unknown_task_is_refused_naming_the_tasks(jina) -> None:
    _, llm = jina
    with pytest.raises(InvalidInputError) as error:
        llm.embed(["the cat"], PoolingParams(lora_task="retrieval.document"), use_tqdm=False)
    message = str(error.value)
    assert "'retrieval.document'" in message and all(t in message for t in TASKS)
    assert llm.embed(["the cat"], PoolingParams(lora_task=TASKS[0]), use_tqdm=False)  # alive


SERVER_ATOL = 1e-5  # the same engine in both processes, fp32


@pytest.fixture(scope="module")
def client(jina):
    import httpx
    from server_fixture import ServerProcess

    folder, _ = jina
    server = ServerProcess(str(folder), "--dtype", "float32", "--num-threads", "1")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client
    finally:
        server.stop()


def test_server_task_field_selects_the_adapter(client, jina) -> None:
    """``/v1/embeddings`` with Jina's ``task`` (and ``/pooling`` with ``lora_task``) equal the
    offline engine under that task."""
    _, llm = jina
    texts = TEXTS[:3]
    for task in ("retrieval.query", "retrieval.passage"):
        expected = [o.outputs.embedding for o in llm.embed(texts, PoolingParams(lora_task=task))]
        body = {"input": texts, "task": task}
        response = client.post("/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
        got = [item["embedding"] for item in response.json()["data"]]
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(expected), atol=SERVER_ATOL, rtol=0
        )
        pooled = client.post("/pooling", json={"input": texts, "task": "embed", "lora_task": task})
        assert pooled.status_code == 200, pooled.text
        got = [item["data"] for item in pooled.json()["data"]]
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(expected), atol=SERVER_ATOL, rtol=0
        )


def test_server_unknown_task_is_a_400_naming_the_tasks(client) -> None:
    response = client.post("/v1/embeddings", json={"input": "the cat", "task": "retrieval"})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "'retrieval'" in message and all(t in message for t in TASKS)
    conflict = {"input": "the cat", "task": TASKS[0], "lora_task": TASKS[1]}
    assert client.post("/v1/embeddings", json=conflict).status_code == 400
    ok = client.post("/v1/embeddings", json={"input": "the cat", "task": TASKS[2]})
    assert ok.status_code == 200, ok.text  # the engine is alive
    assert client.get("/health").status_code == 200


def test_model_without_task_adapters_refuses_a_task(default_server) -> None:
    """A plain text-embedding model (all-MiniLM-L6-v2) given a task: a 400 saying it has no
    per-task adapters, and the server goes on."""
    import httpx

    url = f"{default_server.url}/v1/embeddings"
    response = httpx.post(url, json={"input": "hello", "task": "retrieval.query"}, timeout=60)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "retrieval.query" in message and "has none" in message
    assert httpx.post(url, json={"input": "hello"}, timeout=60).status_code == 200


def test_factors_that_do_not_fit_are_refused_at_load(jina, tmp_path: Path) -> None:
    """A task factor of the wrong shape (another base's adapter) names the module and shapes."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _ = jina
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    state = load_file(broken / "model.safetensors")
    name = "roberta.encoder.layers.1.mlp.fc2.parametrizations.weight.0.lora_B"
    state[name] = state[name][:, :-1].contiguous()  # [tasks, out - 1, r]
    save_file(state, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"encoder\.layers\.1\.mlp\.fc2 lora_A .* do not fit"):
        LLM(str(broken), dtype="float32", num_threads=NUM_THREADS)
