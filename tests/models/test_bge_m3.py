"""BGE-M3: one XLM-R trunk, three outputs, on a tiny random XLMRobertaModel with random
``sparse_linear.pt`` / ``colbert_linear.pt`` heads, fp32.

FlagEmbedding does not import here without its dependencies (``datasets``, ...), so the
reference is written independently from transformers' ``XLMRobertaModel`` (padded batch) and
torch ``Linear`` heads, following FlagEmbedding's published ``BGEM3FlagModel`` formulas: dense =
normalized CLS; lexical weights = ``relu(sparse_linear(h))``, max per token id, the CLS / EOS /
PAD / UNK ids and zero weights dropped; ColBERT = ``colbert_linear(h[1:])`` over the real tokens,
each vector normalized."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F
from factories.encoders import make_encoder_classifier
from factories.texts import random_prompts

from cenote import LLM, PoolingParams, SparseEmbeddingOutput
from cenote.errors import InvalidInputError, UnsupportedTaskError

NUM_THREADS = 2
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs the reference, fp32
SPARSE_RTOL = 1e-5  # the brief: lexical weights, relative
SPARSE_ATOL = 1e-6  # weights that round to ~0 on both sides
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
TEXTS = [
    "the cat sat",
    "a dog",
    "yes no yes yes no",  # repeated tokens: the largest weight per id
    "the mat + the cat - a dog",
    "unknownword the unknownword",  # <unk> is left out
    " ".join(["cat", "dog", "the", "mat"] * 20),
]


def _save_heads(folder: Path, hidden: int, colbert_dim: int, seed: int) -> None:
    torch.manual_seed(seed)
    sparse, colbert = torch.nn.Linear(hidden, 1), torch.nn.Linear(hidden, colbert_dim)
    with torch.no_grad():
        sparse.bias.fill_(0.6)  # most tokens weigh > 0, about 20 weigh 0 (random bias: most did)
    torch.save(sparse.state_dict(), folder / "sparse_linear.pt")
    torch.save(colbert.state_dict(), folder / "colbert_linear.pt")


@pytest.fixture(scope="module")
def m3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bge-m3")
    make_encoder_classifier(folder, "xlm-roberta", "Model", seed=3)
    # name the EOS as XLM-R's tokenizer does, so both sides drop the same four ids
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["eos_token"] = "</s>"
    path.write_text(json.dumps(config))
    _save_heads(folder, hidden=32, colbert_dim=32, seed=7)
    return folder


@pytest.fixture(scope="module")
def llm(m3_folder: Path) -> LLM:
    return LLM(str(m3_folder), dtype="float32", num_threads=NUM_THREADS)


@pytest.fixture(scope="module")
def reference(m3_folder: Path) -> dict[str, list]:
    """FlagEmbedding's three outputs per text, from transformers and torch Linear heads."""
    from transformers import AutoTokenizer, XLMRobertaModel

    torch.set_num_threads(NUM_THREADS)
    tokenizer = AutoTokenizer.from_pretrained(str(m3_folder))
    model = XLMRobertaModel.from_pretrained(str(m3_folder)).eval()
    hidden_size = model.config.hidden_size
    sparse, colbert = torch.nn.Linear(hidden_size, 1), torch.nn.Linear(hidden_size, hidden_size)
    sparse.load_state_dict(torch.load(m3_folder / "sparse_linear.pt", weights_only=True))
    colbert.load_state_dict(torch.load(m3_folder / "colbert_linear.pt", weights_only=True))
    unused = {
        tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map[name])
        for name in ("cls_token", "eos_token", "pad_token", "unk_token")
        if name in tokenizer.special_tokens_map
    }
    assert len(unused) == 4
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # [texts, max_len, hidden]
        dense = F.normalize(hidden[:, 0], dim=-1)
        token_weights = torch.relu(sparse(hidden)).squeeze(-1)  # [texts, max_len]
        vectors = F.normalize(colbert(hidden[:, 1:]), dim=-1)
    lexical, colbert_vecs = [], []
    for i, mask in enumerate(batch["attention_mask"]):
        length = int(mask.sum())
        weights: dict[int, float] = {}
        for token_id, weight in zip(
            batch["input_ids"][i, :length].tolist(), token_weights[i, :length].tolist(), strict=True
        ):
            if token_id not in unused and weight > 0 and weight > weights.get(token_id, 0.0):
                weights[token_id] = weight
        assert len(weights) > 0
        lexical.append(weights)
        colbert_vecs.append(vectors[i, : length - 1])
    return {"dense": list(dense), "lexical": lexical, "colbert": colbert_vecs}


def test_folder_is_found_and_serves_three_tasks(llm: LLM) -> None:
    assert llm.config.model.architecture == "BgeM3EmbeddingModel"
    assert set(llm.supported_tasks) == {"embed", "embed_sparse", "token_embed"}


def test_dense_matches_reference(llm: LLM, reference: dict[str, list]) -> None:
    ours = torch.stack([out.outputs.data for out in llm.embed(TEXTS)])
    theirs = torch.stack(reference["dense"])
    cos = F.cosine_similarity(ours, theirs, dim=-1)
    assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f}"


def test_lexical_weights_match_reference(llm: LLM, reference: dict[str, list]) -> None:
    for out, theirs in zip(llm.embed_sparse(TEXTS), reference["lexical"], strict=True):
        ours = dict(out.outputs.pairs)
        assert set(ours) == set(theirs), f"token ids {sorted(ours)} vs {sorted(theirs)}"
        ids = sorted(theirs)
        torch.testing.assert_close(
            torch.tensor([ours[i] for i in ids]),
            torch.tensor([theirs[i] for i in ids]),
            rtol=SPARSE_RTOL,
            atol=SPARSE_ATOL,
        )


def test_colbert_vectors_match_reference(llm: LLM, reference: dict[str, list]) -> None:
    outputs = llm.encode(TEXTS, pooling_task="token_embed")
    for out, theirs in zip(outputs, reference["colbert"], strict=True):
        ours = out.outputs.data
        assert ours.shape == theirs.shape == (len(out.prompt_token_ids) - 1, 32)
        cos = F.cosine_similarity(ours, theirs, dim=-1)
        assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f}"
        torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(ours)))


def test_each_task_batched_equals_alone(llm: LLM) -> None:
    """Per task, prompts of different lengths in one step equal each prompt alone."""
    prompts = [{"prompt_token_ids": [0, *p, 2]} for p in random_prompts([3, 17, 3, 60], seed=5)]
    for task in ("embed", "embed_sparse", "token_embed"):
        together = llm.encode(prompts, pooling_task=task)
        for prompt, batched in zip(prompts, together, strict=True):
            alone = llm.encode([prompt], pooling_task=task)[0]
            torch.testing.assert_close(
                batched.outputs.data, alone.outputs.data, atol=BATCH_ATOL, rtol=0
            )


def test_three_tasks_share_one_engine_step(m3_folder: Path) -> None:
    """The same texts asked for dense, lexical and ColBERT outputs at once: one step runs all
    the prompts through the trunk and each task's pooler takes its requests' rows; every
    result equals the one asked alone."""
    from factories.generation import record_steps

    llm = LLM(str(m3_folder), dtype="float32", num_threads=NUM_THREADS)
    steps = record_steps(llm)
    prompts = [{"prompt_token_ids": [0, *p, 2]} for p in random_prompts([4, 11, 7], seed=9)]
    tasks = ("embed", "embed_sparse", "token_embed")
    ids = []
    for task in tasks:
        names = [f"{task}-{i}" for i in range(len(prompts))]
        llm.client.add(
            llm.input_processor.process_batch(names, prompts, PoolingParams().with_task(task))
        )
        ids += names
    outputs = llm.client.wait(ids)
    assert len(steps) == 1 and len(steps[0].scheduled) == len(tasks) * len(prompts)
    n = len(prompts)
    for i, task in enumerate(tasks):
        alone = llm.encode(prompts, pooling_task=task)
        for mixed, single in zip(outputs[i * n : (i + 1) * n], alone, strict=True):
            torch.testing.assert_close(
                mixed.outputs.data, single.outputs.data, atol=BATCH_ATOL, rtol=0
            )


ALL_TASKS = ("embed", "embed_sparse", "token_embed")


def test_three_tasks_in_one_request_take_one_trunk_pass(
    m3_folder: Path, reference: dict[str, list]
) -> None:
    """``encode(pooling_task=(...))``: one request per prompt, one step, one trunk call
    (a forward hook counts them) computing each prompt's tokens once, not once per task; the
    three outputs equal FlagEmbedding's."""
    from factories.generation import record_steps

    llm = LLM(str(m3_folder), dtype="float32", num_threads=NUM_THREADS)
    steps = record_steps(llm)
    passes: list[int] = []
    llm.engine.model.register_forward_hook(lambda module, args, out: passes.append(1))
    outputs = llm.encode(TEXTS, pooling_task=ALL_TASKS)
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    assert len(passes) == 1 and len(steps) == 1
    scheduled = steps[0].scheduled
    assert len(scheduled) == len(TEXTS) and sum(s.num_tokens for s in scheduled) == num_tokens
    for i, out in enumerate(outputs):
        assert out.outputs.tasks == ALL_TASKS
        dense = out.outputs["embed"].data
        cos = F.cosine_similarity(dense, reference["dense"][i], dim=0)
        assert cos >= MIN_COSINE_FP32, f"text {i}: dense cosine {cos:.6f}"
        lexical = out.outputs["embed_sparse"]
        assert isinstance(lexical, SparseEmbeddingOutput)
        ours, theirs = dict(lexical.pairs), reference["lexical"][i]
        assert set(ours) == set(theirs), f"text {i}: token ids {sorted(ours)} vs {sorted(theirs)}"
        ids = sorted(theirs)
        torch.testing.assert_close(
            torch.tensor([ours[t] for t in ids]),
            torch.tensor([theirs[t] for t in ids]),
            rtol=SPARSE_RTOL,
            atol=SPARSE_ATOL,
        )
        colbert = out.outputs["token_embed"].data
        assert colbert.shape == reference["colbert"][i].shape
        cos = F.cosine_similarity(colbert, reference["colbert"][i], dim=-1)
        assert cos.min() >= MIN_COSINE_FP32, f"text {i}: ColBERT min cosine {cos.min():.6f}"


def test_multi_task_outputs_equal_single_task_requests(llm: LLM) -> None:
    """Each output of a multi-task request equals the one its task gives alone, and any subset
    in any order comes back in the order asked."""
    combined = llm.encode(TEXTS, pooling_task=list(ALL_TASKS))
    for task in ALL_TASKS:
        alone = llm.encode(TEXTS, pooling_task=task)
        for multi, single in zip(combined, alone, strict=True):
            assert type(multi.outputs[task]) is type(single.outputs)
            torch.testing.assert_close(
                multi.outputs[task].data, single.outputs.data, atol=BATCH_ATOL, rtol=0
            )
    subset = llm.encode(TEXTS[:2], pooling_task=("token_embed", "embed"))
    assert subset[0].outputs.tasks == ("token_embed", "embed")


def test_multi_task_batched_and_mixed_with_single_tasks(m3_folder: Path, llm: LLM) -> None:
    """Multi-task and single-task requests of different lengths share one engine step; every
    result equals its prompt alone (batch invariance, 1e-5)."""
    from factories.generation import record_steps

    mixed_llm = LLM(str(m3_folder), dtype="float32", num_threads=NUM_THREADS)
    steps = record_steps(mixed_llm)
    prompts = [{"prompt_token_ids": [0, *p, 2]} for p in random_prompts([5, 23, 9, 41], seed=4)]
    selections: list[Any] = [ALL_TASKS, "embed_sparse", ("embed", "token_embed"), "embed"]
    names = [f"mixed-{i}" for i in range(len(prompts))]
    requests = []
    for name, prompt, selection in zip(names, prompts, selections, strict=True):
        params = PoolingParams().with_task(selection)
        requests += mixed_llm.input_processor.process_batch([name], [prompt], params)
    mixed_llm.client.add(requests)
    outputs = mixed_llm.client.wait(names)
    assert len(steps) == 1 and len(steps[0].scheduled) == len(prompts)
    for prompt, selection, out in zip(prompts, selections, outputs, strict=True):
        for task in (selection,) if isinstance(selection, str) else selection:
            alone = llm.encode([prompt], pooling_task=task)[0].outputs.data
            got = out.outputs.data if isinstance(selection, str) else out.outputs[task].data
            torch.testing.assert_close(got, alone, atol=BATCH_ATOL, rtol=0)


def test_multi_task_options_apply_to_their_task(llm: LLM) -> None:
    """``max_active_dims`` cuts the sparse output only; the dense and ColBERT ones are whole."""
    out = llm.encode(TEXTS[3:4], PoolingParams(max_active_dims=2), pooling_task=ALL_TASKS)[0]
    assert out.outputs["embed_sparse"].data.count_nonzero() == 2
    whole = llm.encode(TEXTS[3:4], pooling_task="token_embed")[0].outputs.data
    torch.testing.assert_close(out.outputs["token_embed"].data, whole, atol=BATCH_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("selection", "message"),
    [
        ((), r"task is an empty list"),
        (("embed", "embed"), r"task lists embed more than once"),
        (("embed", "classify"), r"task 'classify' is not supported by .*; it supports"),
        (("embed", "bogus"), r"unknown pooling task 'bogus'"),
    ],
)
def test_bad_multi_task_selection_is_a_clear_error(
    llm: LLM, selection: tuple[str, ...], message: str
) -> None:
    with pytest.raises(InvalidInputError, match=message):
        llm.encode(TEXTS[:1], pooling_task=selection)  # type: ignore[call-overload]
    assert llm.encode(TEXTS[:1], pooling_task=ALL_TASKS)  # the engine goes on


def test_multi_task_options_that_fit_no_task_are_refused(llm: LLM) -> None:
    with pytest.raises(InvalidInputError, match=r"max_active_dims applies to embed_sparse, none"):
        llm.encode(TEXTS[:1], PoolingParams(max_active_dims=4), pooling_task=("embed",))
    with pytest.raises(InvalidInputError, match=r"long_input 'chunk' .* several tasks"):
        llm.encode(TEXTS[:1], PoolingParams(long_input="chunk"), pooling_task=ALL_TASKS)


QUERIES = ["the cat sat", "yes no yes"]
DOCUMENTS = ["the mat + the cat - a dog", "no no yes yes the dog"]
CARD_WEIGHTS = [0.4, 0.2, 0.4]  # BGE-M3's model card, compute_score example


def _hand_combined_scores(llm: LLM, weights: list[float]) -> list[float]:
    """FlagEmbedding's "colbert+sparse+dense" of each (QUERIES[i], DOCUMENTS[i]) written out
    from the three single-task outputs: dense dot product; the lexical matching score over the
    token ids both texts hold; the mean over query vectors of the best document match."""
    texts = QUERIES + DOCUMENTS
    dense = [out.outputs.data for out in llm.embed(texts)]
    lexical = [dict(out.outputs.pairs) for out in llm.embed_sparse(texts)]
    colbert = [out.outputs.data for out in llm.encode(texts, pooling_task="token_embed")]
    scores = []
    for q in range(len(QUERIES)):
        d = len(QUERIES) + q
        dense_score = float(dense[q] @ dense[d])
        shared = set(lexical[q]) & set(lexical[d])
        sparse_score = sum(lexical[q][t] * lexical[d][t] for t in shared)
        best = [max(float(v @ w) for w in colbert[d]) for v in colbert[q]]
        colbert_score = sum(best) / len(best)
        total = weights[0] * dense_score + weights[1] * sparse_score + weights[2] * colbert_score
        scores.append(total / sum(weights))
    return scores


def test_combined_score_matches_hand_computation(llm: LLM) -> None:
    for weights in (CARD_WEIGHTS, [1.0, 0.3, 1.0], [0.0, 1.0, 0.0]):
        ours = llm.score(QUERIES, DOCUMENTS, weights_for_different_modes=weights)
        expected = _hand_combined_scores(llm, weights)
        got = [out.outputs.score for out in ours]
        assert got == pytest.approx(expected, abs=1e-5), f"weights {weights}"
    # without the option: the dense cosine, as before
    plain = [out.outputs.score for out in llm.score(QUERIES, DOCUMENTS)]
    dense = llm.embed(QUERIES + DOCUMENTS)
    cosines = [float(dense[i].outputs.data @ dense[i + 2].outputs.data) for i in range(2)]
    assert plain == pytest.approx(cosines, abs=1e-5)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([0.4, 0.6], r"must be 3 finite non-negative numbers"),
        ([0.4, -0.2, 0.4], r"must be 3 finite non-negative numbers"),
        ([0.0, 0.0, 0.0], r"sum to 0"),
    ],
)
def test_bad_mode_weights_are_a_clear_error(llm: LLM, weights: list[float], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        llm.score(QUERIES, DOCUMENTS, weights_for_different_modes=weights)


def test_folder_without_both_heads_is_a_plain_xlm_r(m3_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "one-head"
    shutil.copytree(m3_folder, folder)
    (folder / "colbert_linear.pt").unlink()
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    assert llm.config.model.architecture == "XLMRobertaModel"
    assert "embed_sparse" not in llm.supported_tasks
    with pytest.raises(UnsupportedTaskError, match=r"combines BGE-M3's .* not embed_sparse"):
        llm.score(QUERIES, DOCUMENTS, weights_for_different_modes=CARD_WEIGHTS)
    with pytest.raises(UnsupportedTaskError, match=r"task 'embed_sparse' is not supported"):
        llm.encode(TEXTS[:1], pooling_task=("embed", "embed_sparse"))


def test_head_of_wrong_shape_is_a_clear_error(m3_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bad-head"
    shutil.copytree(m3_folder, folder)
    torch.save(torch.nn.Linear(16, 1).state_dict(), folder / "sparse_linear.pt")
    with pytest.raises(ValueError, match=r"sparse_linear\.pt: weight \(1, 16\)"):
        LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)


SERVER_ATOL = 1e-5  # the same engine in both processes, fp32


@pytest.fixture(scope="module")
def client(m3_folder: Path):
    from server_fixture import ServerProcess

    server = ServerProcess(str(m3_folder), "--dtype", "float32", "--num-threads", "1")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client
    finally:
        server.stop()


def test_server_serves_the_three_outputs(client: httpx.Client, llm: LLM) -> None:
    """``/v1/embeddings`` dense, ``/embed_sparse`` (TEI shape) lexical weights and ``/pooling``
    ``token_embed`` ColBERT vectors from one served model, equal to the offline engine."""
    texts = TEXTS[:4]
    dense = client.post("/v1/embeddings", json={"input": texts})
    assert dense.status_code == 200, dense.text
    got = torch.tensor([item["embedding"] for item in dense.json()["data"]])
    expected = torch.stack([out.outputs.data for out in llm.embed(texts)])
    torch.testing.assert_close(got, expected, atol=SERVER_ATOL, rtol=0)

    sparse = client.post("/embed_sparse", json={"inputs": texts})
    assert sparse.status_code == 200, sparse.text
    for entries, out in zip(sparse.json(), llm.embed_sparse(texts), strict=True):
        assert {e["index"]: pytest.approx(e["value"], abs=SERVER_ATOL) for e in entries} == dict(
            out.outputs.pairs
        )

    tokens = client.post("/pooling", json={"input": texts, "task": "token_embed"})
    assert tokens.status_code == 200, tokens.text
    offline = llm.encode(texts, pooling_task="token_embed")
    for item, out in zip(tokens.json()["data"], offline, strict=True):
        torch.testing.assert_close(
            torch.tensor(item["data"]), out.outputs.data, atol=SERVER_ATOL, rtol=0
        )
    assert client.get("/info").json()["model_type"] == {"embedding": {"pooling": "cls"}}
    assert client.get("/health").status_code == 200


def test_server_pooling_answers_several_tasks(client: httpx.Client, llm: LLM) -> None:
    """``/pooling`` with ``task`` a list: each input's ``data`` maps every task to the output
    the offline engine gives for it (the sparse one as its vocabulary vector, as the
    single-task ``/pooling``)."""
    from cenote.server.responses import PoolingResponse

    texts = TEXTS[:3]
    response = client.post("/pooling", json={"input": texts, "task": list(ALL_TASKS)})
    assert response.status_code == 200, response.text
    PoolingResponse.model_validate(response.json())  # the shape the OpenAPI schema states
    offline = llm.encode(texts, pooling_task=ALL_TASKS)
    for item, out in zip(response.json()["data"], offline, strict=True):
        assert list(item["data"]) == list(ALL_TASKS)
        for task in ALL_TASKS:
            torch.testing.assert_close(
                torch.tensor(item["data"][task]), out.outputs[task].data, atol=SERVER_ATOL, rtol=0
            )
    encoded = client.post(
        "/pooling",
        json={"input": texts[0], "task": ["embed", "token_embed"], "encoding_format": "base64"},
    )
    assert encoded.status_code == 200, encoded.text
    assert set(encoded.json()["data"][0]["data"]) == {"embed", "token_embed"}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"task": []}, "task is an empty list"),
        ({"task": ["embed", "embed"]}, "task lists embed more than once"),
        ({"task": ["embed", "classify"]}, "task 'classify' is not supported by"),
        ({"task": ["embed", "rank"]}, "(got 'rank')"),
        ({"task": list(ALL_TASKS), "encoding_format": "bytes"}, "answers float or base64"),
        ({"task": ["embed_sparse"], "dimensions": 8}, "dimensions applies to embed / token_embed"),
    ],
)
def test_server_bad_task_lists_are_400(
    client: httpx.Client, body: dict[str, Any], message: str
) -> None:
    response = client.post("/pooling", json={"input": "the cat", **body})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert client.get("/health").status_code == 200


def test_server_score_combines_the_three_modes(client: httpx.Client, llm: LLM) -> None:
    """``/score`` with ``weights_for_different_modes``: the offline combined scores."""
    response = client.post(
        "/score",
        json={
            "queries": QUERIES,
            "documents": DOCUMENTS,
            "weights_for_different_modes": [1, 0.3, 1],
        },
    )
    assert response.status_code == 200, response.text
    got = [item["score"] for item in response.json()["data"]]
    offline = llm.score(QUERIES, DOCUMENTS, weights_for_different_modes=[1.0, 0.3, 1.0])
    assert got == pytest.approx([out.outputs.score for out in offline], abs=SERVER_ATOL)
    reranked = client.post(
        "/rerank",
        json={
            "query": QUERIES[0],
            "documents": DOCUMENTS,
            "weights_for_different_modes": [1, 0.3, 1],
        },
    )
    assert reranked.status_code == 200, reranked.text
    expected = llm.score(QUERIES[0], DOCUMENTS, weights_for_different_modes=[1.0, 0.3, 1.0])
    by_index = {r["index"]: r["relevance_score"] for r in reranked.json()["results"]}
    assert [by_index[i] for i in range(len(DOCUMENTS))] == pytest.approx(
        [out.outputs.score for out in expected], abs=SERVER_ATOL
    )
    refused = client.post(
        "/v1/score",
        json={"queries": QUERIES, "documents": DOCUMENTS, "weights_for_different_modes": [1, 1]},
    )
    assert refused.status_code == 400, refused.text
    assert "at least 3 items" in refused.json()["error"]["message"]
    refused = client.post(
        "/score",
        json={"queries": QUERIES, "documents": DOCUMENTS, "weights_for_different_modes": [0, 0, 0]},
    )
    assert refused.status_code == 400, refused.text
    assert "sum to 0" in refused.json()["error"]["message"]
