"""PyLate ColBERT folders (BERT and ModernBERT trunks + a Dense without bias) vs
sentence-transformers 6 ``MultiVectorEncoder``, which loads them as PyLate does: queries
``[CLS] [Q] ... [SEP]`` padded with [MASK] to query_length (the expansion hidden from attention
unless attend_to_expansion_tokens), documents ``[CLS] [D] ... [SEP]`` cut to document_length
with the skiplist words left out, token vectors normalized, MaxSim scores. Tiny random weights,
fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_THREADS
from factories.encoder_zoo import TEXTS
from factories.pylate import ADDED_MARKERS, VOCAB_MARKERS, save_pylate

from cenote import LLM, PoolingParams
from cenote.errors import InvalidInputError, UnknownArchitectureError

MIN_COSINE = 0.9999  # DESIGN.md §3: token vectors vs sentence-transformers, fp32
SCORE_ATOL = 1e-5  # MaxSim scores vs sentence-transformers, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
QUERY_LENGTH, DOCUMENT_LENGTH, DIM = 12, 16, 16
QUERIES = ["the cat sat", "a dog ?", "query " * 20]  # the last is cut to query_length
DOCUMENTS = [*TEXTS, "cat , dog . mat ! the ?"]  # some over document_length; punctuation

# (trunk, markers, attend_to_expansion_tokens, do_query_expansion)
VARIANTS = {
    "bert-added-markers": ("Bert", ADDED_MARKERS, False, True),
    "bert-attend-expansion": ("Bert", VOCAB_MARKERS, True, True),
    "modernbert": ("ModernBert", VOCAB_MARKERS, False, True),
    "modernbert-no-expansion": ("ModernBert", ADDED_MARKERS, False, False),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pylate(request, tmp_path_factory: pytest.TempPathFactory):
    from sentence_transformers import MultiVectorEncoder

    trunk, markers, attend, expansion = VARIANTS[request.param]
    folder = save_pylate(
        tmp_path_factory.mktemp("pylate") / "model", trunk, markers,
        query_length=QUERY_LENGTH, document_length=DOCUMENT_LENGTH, dim=DIM,
        attend_to_expansion_tokens=attend, do_query_expansion=expansion,
    )  # fmt: skip
    reference = MultiVectorEncoder(str(folder), device="cpu")
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    return folder, llm, reference, expansion


def _token_embed(llm: LLM, prompts: list) -> list:
    return llm.encode(prompts, PoolingParams(), pooling_task="token_embed", use_tqdm=False)


def _queries(llm: LLM) -> list:
    """The queries as the engine formats them (role "query"), as token-id prompts."""
    ids = [f"q{i}" for i in range(len(QUERIES))]
    params = PoolingParams(task="token_embed")
    formatted = llm.input_processor.process_batch(ids, QUERIES, params, role="query")
    return [{"prompt_token_ids": f.prompt_token_ids} for f in formatted]


def _check_rows(ours: torch.Tensor, ids: list[int], features: dict) -> None:
    """``ours`` [len(ids), DIM] vs the reference's features of one text: the same token ids,
    each scored row within MIN_COSINE (and unit length), each row left out of scoring zero."""
    num_tokens = len(ids)
    assert features["input_ids"][:num_tokens].tolist() == ids
    assert (features["attention_mask"][num_tokens:] == 0).all()  # only padding after ours
    scored = features["attention_mask"][:num_tokens].bool()
    expected = features["token_embeddings"][:num_tokens][scored]
    cosine = F.cosine_similarity(ours[scored], expected, dim=-1)
    assert cosine.min().item() >= MIN_COSINE, cosine
    torch.testing.assert_close(ours[scored].norm(dim=-1), torch.ones(int(scored.sum())))
    assert (ours[~scored] == 0).all()


def test_documents_match_multi_vector_encoder(pylate) -> None:
    _, llm, reference, _ = pylate
    assert llm.supported_tasks == ("token_embed",)
    features = reference.encode_document(DOCUMENTS, output_value=None)
    outputs = _token_embed(llm, DOCUMENTS)
    for out, expected in zip(outputs, features, strict=True):
        assert len(out.prompt_token_ids) <= DOCUMENT_LENGTH
        _check_rows(out.outputs.data, out.prompt_token_ids, expected)
    assert (outputs[-1].outputs.data == 0).all(dim=-1).sum() == 4  # its punctuation


def test_queries_match_multi_vector_encoder(pylate) -> None:
    _, llm, reference, expansion = pylate
    features = reference.encode_query(QUERIES, output_value=None)
    outputs = llm.encode(QUERIES, pooling_task="token_embed", role="query", use_tqdm=False)
    for out, expected in zip(outputs, features, strict=True):
        _check_rows(out.outputs.data, out.prompt_token_ids, expected)
    mask_id = reference.tokenizer.mask_token_id
    assert (outputs[0].prompt_token_ids[-1] == mask_id) == expansion
    assert len(outputs[2].prompt_token_ids) == QUERY_LENGTH  # cut, as PyLate cuts


def test_score_matches_maxsim(pylate) -> None:
    _, llm, reference, _ = pylate
    expected = reference.similarity(
        reference.encode_query(QUERIES), reference.encode_document(DOCUMENTS)
    )  # [queries, documents]
    for i, query in enumerate(QUERIES):
        outputs = llm.score(query, DOCUMENTS, use_tqdm=False)
        scores = torch.tensor([out.outputs.score for out in outputs])
        torch.testing.assert_close(scores, expected[i], atol=SCORE_ATOL, rtol=0)


def test_batch_invariance(pylate) -> None:
    _, llm, _, _ = pylate
    prompts = [*DOCUMENTS, *_queries(llm)]
    together = _token_embed(llm, prompts)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _token_embed(llm, [prompt])
        torch.testing.assert_close(
            batched.outputs.data, alone.outputs.data, atol=BATCH_ATOL, rtol=0
        )


def test_embed_is_refused(pylate) -> None:
    _, llm, _, _ = pylate
    with pytest.raises(ValueError, match="embed"):
        llm.embed(["the cat"], use_tqdm=False)


def _edited_copy(source: Path, target: Path, path: str, **entries) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / path).read_text())
    (target / path).write_text(json.dumps({**config, **entries}))
    return target


def test_unsupported_folders_are_refused_at_load(pylate, tmp_path: Path) -> None:
    folder = pylate[0]
    biased = _edited_copy(folder, tmp_path / "bias", "1_Dense/config.json", bias=True)
    with pytest.raises(ValueError, match="one Dense module without bias or activation"):
        LLM(str(biased), dtype="float32")
    other = _edited_copy(folder, tmp_path / "trunk", "config.json", architectures=["MPNetModel"])
    with pytest.raises(UnknownArchitectureError, match="PyLate ColBERT folder over 'MPNetModel'"):
        LLM(str(other), dtype="float32")
    unknown = _edited_copy(
        folder, tmp_path / "marker", "config_sentence_transformers.json", query_prefix="[X] "
    )
    with pytest.raises(ValueError, match=r"ColBERT token '\[X\] ' is not in the tokenizer"):
        LLM(str(unknown), dtype="float32")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """A ModernBERT PyLate folder behind ``cenote serve``, and its reference."""
    from sentence_transformers import MultiVectorEncoder
    from server_fixture import ServerProcess

    folder = save_pylate(
        tmp_path_factory.mktemp("served") / "model", "ModernBert", ADDED_MARKERS,
        query_length=QUERY_LENGTH, document_length=DOCUMENT_LENGTH, dim=DIM,
    )  # fmt: skip
    server = ServerProcess(str(folder), "--dtype", "float32", "--num-threads", "1")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client, MultiVectorEncoder(str(folder), device="cpu")
    finally:
        server.stop()


def test_rerank_orders_by_maxsim(served) -> None:
    client, reference = served
    query = QUERIES[0]
    expected = reference.similarity(
        reference.encode_query([query]), reference.encode_document(DOCUMENTS)
    )[0]
    response = client.post("/rerank", json={"query": query, "documents": DOCUMENTS, "top_n": 3})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["index"] for r in results] == expected.argsort(descending=True)[:3].tolist()
    for result in results:
        assert result["relevance_score"] == pytest.approx(
            expected[result["index"]].item(), abs=SCORE_ATOL
        )


def test_server_refuses_what_the_model_cannot_do(served) -> None:
    """A one-vector embedding or a classification of a ColBERT model are clear 400s; the
    engine serves on."""
    client, _ = served
    response = client.post("/v1/embeddings", json={"input": ["the cat"]})
    assert response.status_code == 400, response.text
    assert "embed" in response.json()["error"]["message"]
    response = client.post("/pooling", json={"input": ["the cat"], "task": "classify"})
    assert response.status_code == 400, response.text
    assert "classify" in response.json()["error"]["message"]
    assert client.post("/rerank", json={"query": "cat", "documents": ["a cat"]}).status_code == 200


def test_role_is_refused_on_other_models(pylate, tmp_path: Path) -> None:
    """Without its PyLate settings the folder is a plain encoder: it has no query format."""
    plain = tmp_path / "plain"
    shutil.copytree(pylate[0], plain)
    (plain / "config_sentence_transformers.json").unlink()
    (plain / "modules.json").unlink()
    llm = LLM(str(plain), dtype="float32", num_threads=NUM_THREADS)
    with pytest.raises(InvalidInputError, match="role applies to ColBERT models"):
        llm.encode(["the cat"], pooling_task="token_embed", role="query", use_tqdm=False)
