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


SCORE_ATOL = 1e-5  # the bound: a score vs the cosine of the reference embeddings
QUERY = "the cat sat"
DOCUMENTS = ["a dog", "the mat . the cat , the dog !", "query document"]
# what a score call's task embeds each side under (lora.tasks.score_tasks)
SIDES = {"text-matching": ("text-matching",) * 2, "retrieval": tuple(TASKS[:2])}


def _reference_scores(folder: Path, tmp: Path, llm: LLM, task: str) -> list[float]:
    """Cosine of the query's and each document's embeddings, each side by the reference with
    its task's adapter merged and its instruction before the text."""
    query_task, document_task = SIDES[task]
    query = _reference_embeddings(
        _reference(folder, tmp, query_task), llm, [INSTRUCTIONS[query_task] + QUERY]
    )
    documents = _reference_embeddings(
        _reference(folder, tmp, document_task),
        llm,
        [INSTRUCTIONS[document_task] + d for d in DOCUMENTS],
    )
    return F.cosine_similarity(query, documents, dim=-1).tolist()


@pytest.fixture(scope="module")
def reference_scores(jina, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    folder, llm = jina
    tmp = tmp_path_factory.mktemp("score-references")
    return {task: _reference_scores(folder, tmp, llm, task) for task in SIDES}


@pytest.mark.parametrize("task", list(SIDES))
def test_score_is_the_cosine_of_the_task_embeddings(jina, reference_scores, task: str) -> None:
    """``LLM.score(lora_task=)`` (and the same task in its PoolingParams): "text-matching" embeds
    both sides under its adapter; "retrieval" the query under retrieval.query and the documents
    under retrieval.passage, as the model card pairs them."""
    _, llm = jina
    expected = torch.tensor(reference_scores[task])
    by_keyword = llm.score(QUERY, DOCUMENTS, lora_task=task, use_tqdm=False)
    by_params = llm.score(QUERY, DOCUMENTS, PoolingParams(lora_task=task), use_tqdm=False)
    for outputs in (by_keyword, by_params):
        got = torch.tensor([out.outputs.score for out in outputs])
        torch.testing.assert_close(got, expected, atol=SCORE_ATOL, rtol=0)
    base = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)])
    assert (base - expected).abs().max() > 1e-3  # the task changed the scores


def test_score_with_an_unknown_task_is_refused_naming_the_tasks(jina) -> None:
    _, llm = jina
    with pytest.raises(InvalidInputError) as error:
        llm.score(QUERY, DOCUMENTS, lora_task="retrieval.document", use_tqdm=False)
    message = str(error.value)
    assert "'retrieval.document'" in message and all(t in message for t in TASKS)
    assert "'retrieval'" in message  # scoring's own name for the query/passage pair
    assert llm.score(QUERY, DOCUMENTS, lora_task="retrieval", use_tqdm=False)  # alive


def test_score_plan_runs_under_the_served_adapter_or_the_task_never_both(jina) -> None:
    """``plan_scores(lora_request=)`` (a served adapter, as the routes pass it) puts every query
    and document under it; combined with a task it is a 400, as for embeddings."""
    from cenote.engine.scoring import pair_texts, plan_scores
    from cenote.lora_request import LoRARequest

    _, llm = jina
    adapter = LoRARequest("served", 1, "/nowhere")
    pairs = pair_texts(QUERY, DOCUMENTS)
    plan = plan_scores(llm.input_processor, "plan", pairs, lora_request=adapter)
    children = [child for request in plan.requests for child in request.children]
    assert len(children) == 1 + len(DOCUMENTS)
    assert all(child.lora_request is adapter for child in children)
    with pytest.raises(InvalidInputError, match="cannot run under adapter 'served'"):
        plan_scores(
            llm.input_processor, "plan", pairs, PoolingParams(lora_task="retrieval"),
            lora_request=adapter,
        )  # fmt: skip


CHUNK_MAX_LEN = 16  # tokens per window; the long text below spans several


def test_long_input_windows_all_run_under_the_task(jina, tmp_path: Path) -> None:
    """``long_input="chunk"`` with a task: every window carries the task's instruction and runs
    under its adapter; the joined embedding is the mean over every token of every window of the
    reference with that adapter merged (sentence-transformers' MEAN over windows)."""
    folder, _ = jina
    task = "retrieval.query"
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS, max_model_len=CHUNK_MAX_LEN)
    text = " ".join(TEXTS * 3)
    params = PoolingParams(lora_task=task, long_input="chunk")
    (out,) = llm.embed([text], params, use_tqdm=False)
    tokenizer = llm.tokenizer
    full = tokenizer.encode(INSTRUCTIONS[task] + text).ids  # <s> instruction body </s>
    head = 1 + len(tokenizer.encode(INSTRUCTIONS[task], add_special_tokens=False).ids)
    front, body, back = full[:head], full[head:-1], full[-1:]
    room = CHUNK_MAX_LEN - head - 1
    assert len(body) > 2 * room  # three windows or more
    reference = _reference(folder, tmp_path, task)
    rows = []
    for start in range(0, len(body), room):
        ids = front + body[start : start + room] + back
        with torch.no_grad():
            rows.append(reference(input_ids=torch.tensor([ids])).last_hidden_state[0])
    expected = F.normalize(torch.cat(rows).mean(0), dim=-1)
    got = torch.tensor(out.outputs.embedding)
    assert F.cosine_similarity(got, expected, dim=0) >= MIN_COSINE_FP32
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_batch_lines_carry_the_task(jina, tmp_path: Path) -> None:
    """run-batch: /v1/embeddings, /v1/score and /v1/rerank lines with ``task`` equal the offline
    calls under it; a line with an unknown task fails alone (400 naming the tasks)."""
    import json

    from cenote.cli.run_batch import run_batch

    _, llm = jina
    bodies = [
        ("/v1/embeddings", {"input": DOCUMENTS, "task": "retrieval.passage"}),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS, "task": "retrieval"}),
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "lora_task": "text-matching"}),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS, "task": "retrieval.document"}),
    ]
    lines = [
        json.dumps({"custom_id": str(i), "method": "POST", "url": url, "body": body})
        for i, (url, body) in enumerate(bodies)
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    run_batch(llm, source, target)
    results = {r["custom_id"]: r for r in map(json.loads, target.read_text().splitlines())}
    embedded = results["0"]["response"]["body"]["data"]
    expected = llm.embed(DOCUMENTS, PoolingParams(lora_task="retrieval.passage"), use_tqdm=False)
    torch.testing.assert_close(
        torch.tensor([item["embedding"] for item in embedded]),
        torch.tensor([o.outputs.embedding for o in expected]),
        atol=SERVER_ATOL, rtol=0,
    )  # fmt: skip
    scores = [item["score"] for item in results["1"]["response"]["body"]["data"]]
    expected_scores = llm.score(QUERY, DOCUMENTS, lora_task="retrieval", use_tqdm=False)
    torch.testing.assert_close(
        torch.tensor(scores), torch.tensor([o.outputs.score for o in expected_scores]),
        atol=SERVER_ATOL, rtol=0,
    )  # fmt: skip
    ranked = results["2"]["response"]["body"]["results"]
    matching = llm.score(QUERY, DOCUMENTS, lora_task="text-matching", use_tqdm=False)
    for item in ranked:
        expected_score = matching[item["index"]].outputs.score
        assert abs(item["relevance_score"] - expected_score) <= SERVER_ATOL
    bad = results["3"]
    assert bad["response"]["status_code"] == 400
    assert "'retrieval.document'" in bad["error"]["message"]
    assert all(t in bad["error"]["message"] for t in TASKS)


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


SCORE_ROUTES = [
    ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    ("/v1/score", {"queries": QUERY, "documents": DOCUMENTS}),
    ("/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    ("/v2/rerank", {"query": QUERY, "documents": DOCUMENTS}),
]


def _route_scores(response) -> list[float]:
    """Scores in document order from a score (``data``) or rerank (``results``) answer."""
    assert response.status_code == 200, response.text
    body = response.json()
    if "data" in body:
        return [item["score"] for item in sorted(body["data"], key=lambda x: x["index"])]
    return [r["relevance_score"] for r in sorted(body["results"], key=lambda x: x["index"])]


@pytest.mark.parametrize("field", ["task", "lora_task"])
def test_server_score_and_rerank_take_the_task(client, jina, field: str) -> None:
    """Every score and rerank route with ``task`` (Jina's name) or ``lora_task`` equals
    ``LLM.score`` under that task; "retrieval" pairs retrieval.query with retrieval.passage."""
    _, llm = jina
    for task in ("retrieval", "text-matching"):
        expected = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, lora_task=task)]
        for route, body in SCORE_ROUTES:
            got = _route_scores(client.post(route, json={**body, field: task}))
            torch.testing.assert_close(
                torch.tensor(got), torch.tensor(expected), atol=SERVER_ATOL, rtol=0
            )


@pytest.mark.parametrize(("route", "body"), SCORE_ROUTES)
def test_server_score_with_a_bad_task_is_a_400(client, route: str, body: dict) -> None:
    """An unknown task names the model's tasks; ``task`` and ``lora_task`` that differ are
    refused; the engine goes on."""
    response = client.post(route, json={**body, "task": "retrieval.document"})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "'retrieval.document'" in message and all(t in message for t in TASKS)
    conflict = {**body, "task": TASKS[0], "lora_task": TASKS[1]}
    response = client.post(route, json=conflict)
    assert response.status_code == 400, response.text
    assert "name different adapters" in response.json()["error"]["message"]
    _route_scores(client.post(route, json={**body, "task": "retrieval"}))  # alive
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
