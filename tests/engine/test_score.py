"""LLM.score: cross-encoders vs sentence-transformers CrossEncoder, bi-encoders vs
SentenceTransformer.similarity, late interaction vs numpy MaxSim; input-shape errors."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from factories.encoders import make_encoder_classifier
from factories.seeded import set_config

from cenote import LLM, PoolingParams
from cenote.errors import InvalidInputError

ATOL = 1e-4
QUERY = "the cat sat on the mat"
DOCUMENTS = ["a cat sat", "dog", "the mat w40 w41 w42 w43 yes no", "query document"]


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT cross-encoder saved by sentence-transformers (activation_fn: Sigmoid)."""
    from sentence_transformers import CrossEncoder

    raw = tmp_path_factory.mktemp("raw")
    make_encoder_classifier(raw, "bert", "ForSequenceClassification", num_labels=1)
    saved = tmp_path_factory.mktemp("cross_encoder")
    CrossEncoder(str(raw), device="cpu").save(str(saved))
    return saved


@pytest.fixture(scope="module")
def cross_llm(cross_encoder_dir: Path) -> LLM:
    return LLM(str(cross_encoder_dir), dtype="float32", num_threads=1)


def _predict(path: Path, pairs: list[tuple[str, str]], **kwargs) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu", **kwargs).predict(pairs, batch_size=8)


def test_cross_encoder_matches_sentence_transformers(cross_encoder_dir, cross_llm) -> None:
    expected = _predict(cross_encoder_dir, [(QUERY, d) for d in DOCUMENTS])
    outputs = cross_llm.score(QUERY, DOCUMENTS)  # 1 -> N
    got = np.array([o.outputs.score for o in outputs])
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    zipped = cross_llm.score([QUERY, "dog"], ["a cat sat", "yes"])  # N -> N
    expected = _predict(cross_encoder_dir, [(QUERY, "a cat sat"), ("dog", "yes")])
    np.testing.assert_allclose([o.outputs.score for o in zipped], expected, atol=ATOL, rtol=0)
    single = cross_llm.score("dog", "a cat sat")  # 1 -> 1
    assert len(single) == 1


def test_cross_encoder_identity_activation_from_config(
    cross_encoder_dir, cross_llm, tmp_path
) -> None:
    import shutil

    folder = tmp_path / "identity"
    shutil.copytree(cross_encoder_dir, folder)
    (folder / "config_sentence_transformers.json").unlink()
    set_config(folder, sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    expected = _predict(folder, [(QUERY, d) for d in DOCUMENTS])
    llm = LLM(str(folder), dtype="float32", num_threads=1)
    got = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS)]
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    with_sigmoid = [o.outputs.score for o in cross_llm.score(QUERY, DOCUMENTS)]
    np.testing.assert_allclose(1 / (1 + np.exp(-np.array(got))), with_sigmoid, atol=ATOL)


def test_use_activation_false_gives_the_raw_logit(cross_llm) -> None:
    """LLM.score takes the pooling params the routes take: use_activation=False skips the
    cross-encoder's sigmoid."""
    activated = [o.outputs.score for o in cross_llm.score(QUERY, DOCUMENTS)]
    raw = cross_llm.score(QUERY, DOCUMENTS, PoolingParams(use_activation=False))
    logits = torch.tensor([o.outputs.score for o in raw])
    torch.testing.assert_close(torch.sigmoid(logits), torch.tensor(activated), atol=1e-6, rtol=0)
    assert (logits < 0).any() or (logits > 1).any()  # not probabilities
    with pytest.raises(InvalidInputError, match="pooling params are for task 'embed'"):
        cross_llm.score(QUERY, DOCUMENTS, PoolingParams(task="embed"))


def test_pair_tokens_and_document_truncation(cross_llm) -> None:
    [full] = cross_llm.score("cat dog", "w50 w51 w52 w53")
    assert full.prompt_token_ids == [2, 9, 10, 3, 50, 51, 52, 53, 3]  # [CLS] q [SEP] d [SEP]
    [cut] = cross_llm.score("cat dog", "w50 w51 w52 w53", max_tokens_per_doc=2)
    assert cut.prompt_token_ids == [2, 9, 10, 3, 50, 51, 3]
    [cut] = cross_llm.score("cat dog", "w50 w51 w52 w53", truncate_prompt_tokens=6)
    assert cut.prompt_token_ids == [2, 9, 10, 3, 50, 3]  # the document is cut, not the query
    with pytest.raises(InvalidInputError, match="the query has 2 tokens"):
        cross_llm.score("cat dog", "w50", truncate_prompt_tokens=4)


def test_score_shape_errors(cross_llm) -> None:
    with pytest.raises(InvalidInputError, match="got 2 queries and 3 documents"):
        cross_llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(InvalidInputError, match="empty list"):
        cross_llm.score("a", [])
    with pytest.raises(InvalidInputError, match=r"text_2\[1\] is a int, not str"):
        cross_llm.score("a", ["b", 5])


def test_bi_encoder_matches_sentence_transformers_similarity(llm_fp32, st_model) -> None:
    queries = ["What is the capital of France?", "How do cats sleep?"]
    documents = ["Paris is the capital of France.", "Cats sleep most of the day."]
    expected = st_model.similarity(
        st_model.encode(queries, convert_to_tensor=True),
        st_model.encode(documents, convert_to_tensor=True),
    ).diagonal()
    got = torch.tensor([o.outputs.score for o in llm_fp32.score(queries, documents)])
    torch.testing.assert_close(got, expected.float(), atol=ATOL, rtol=0)


def test_late_interaction_maxsim_matches_numpy(tmp_path: Path) -> None:
    ref = make_encoder_classifier(tmp_path, "bert", "ForSequenceClassification").bert
    set_config(tmp_path, architectures=["BertModel"], score_type="late_interaction")
    llm = LLM(str(tmp_path), dtype="float32", num_threads=1)
    outputs = llm.score(QUERY, DOCUMENTS)

    def token_vectors(text: str) -> np.ndarray:
        ids = llm.tokenizer.encode(text).ids
        with torch.no_grad():
            hidden = ref(torch.tensor([ids])).last_hidden_state[0].numpy()
        return hidden / np.linalg.norm(hidden, axis=-1, keepdims=True)

    q = token_vectors(QUERY)
    for document, out in zip(DOCUMENTS, outputs, strict=True):
        expected = (q @ token_vectors(document).T).max(axis=1).sum()
        assert abs(out.outputs.score - expected) < ATOL * len(q)


class _CountingTokenizer:
    """The model's tokenizer, counting how often each text is encoded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.encoded: Counter[str] = Counter()

    def encode(self, text, *args, **kwargs):
        self.encoded[text] += 1
        return self.tokenizer.encode(text, *args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self.encoded.update(texts)
        return self.tokenizer.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def _count_encodings(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> _CountingTokenizer:
    counting = _CountingTokenizer(llm.input_processor.tokenizer)
    monkeypatch.setattr(llm.input_processor, "tokenizer", counting)
    monkeypatch.setattr(llm.input_processor.prompts, "tokenizer", counting)
    return counting


def test_score_tokenizes_each_text_once(llm_fp32, cross_llm, cross_encoder_dir, monkeypatch):
    """Length checks and truncation read the one tokenization the requests are made of; the
    scores are those of the embeddings (bi-encoder) and of sentence-transformers (cross)."""
    queries = ["What is the capital of France?", "How do cats sleep?"]
    documents = ["Paris is the capital of France.", "Cats sleep most of the day."]
    embeddings = [out.outputs.data for out in llm_fp32.embed(queries + documents)]
    counting = _count_encodings(llm_fp32, monkeypatch)
    scores = [out.outputs.score for out in llm_fp32.score(queries, documents)]
    assert counting.encoded == Counter(queries + documents)
    expected = torch.nn.functional.cosine_similarity(
        torch.stack(embeddings[:2]), torch.stack(embeddings[2:])
    )
    torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-6, rtol=0)

    counting = _count_encodings(cross_llm, monkeypatch)
    outputs = cross_llm.score(QUERY, DOCUMENTS)  # 1 -> N: the query is in every pair
    assert counting.encoded == Counter([QUERY] * len(DOCUMENTS) + DOCUMENTS)
    expected = _predict(cross_encoder_dir, [(QUERY, d) for d in DOCUMENTS])
    np.testing.assert_allclose([o.outputs.score for o in outputs], expected, atol=ATOL, rtol=0)
    counting.encoded.clear()
    cross_llm.score(QUERY, DOCUMENTS, max_tokens_per_doc=2)  # documents cut: still once
    assert counting.encoded == Counter([QUERY] * len(DOCUMENTS) + DOCUMENTS)


@pytest.mark.parametrize("overlap", [0, 3])
def test_chunk_and_max_reranking_is_the_best_window(cross_encoder_dir, cross_llm, overlap) -> None:
    """``rerank_chunking="max"``: a document past the window is read in windows (the query
    whole in each) and scores as its best window, which ``chunk_index`` names; the reference is
    sentence-transformers' CrossEncoder on each window's text (one token per word here)."""
    limit = cross_llm.config.model.max_model_len
    words = [f"w{40 + i % 20}" for i in range(2 * limit + 7)]
    query = "the cat sat"
    room = limit - 3 - 3  # [CLS] q [SEP] window [SEP]: 3 query tokens, 3 special
    windows, start = [], 0
    while True:
        windows.append(" ".join(words[start : start + room]))
        if start + room >= len(words):
            break
        start += room - overlap
    expected = _predict(cross_encoder_dir, [(query, w) for w in windows])
    documents = [" ".join(words), "a cat sat"]
    long, short = cross_llm.score(query, documents, rerank_chunking="max", chunk_overlap=overlap)
    assert long.outputs.chunk_index == int(np.argmax(expected)) and len(windows) >= 3
    np.testing.assert_allclose(long.outputs.score, expected.max(), atol=ATOL, rtol=0)
    assert len(long.prompt_token_ids) == sum(len(w.split()) + 6 for w in windows)  # all read
    (plain,) = cross_llm.score(query, "a cat sat")
    np.testing.assert_allclose(short.outputs.score, plain.outputs.score, atol=1e-6, rtol=0)
    assert short.outputs.chunk_index == 0
    with pytest.raises(InvalidInputError, match="must be more than chunk_overlap"):
        cross_llm.score(query, documents, rerank_chunking="max", chunk_overlap=room)


def test_chunk_and_max_needs_a_cross_encoder(llm_fp32) -> None:
    with pytest.raises(InvalidInputError, match="applies to cross-encoders"):
        llm_fp32.score("a", "b", rerank_chunking="max")
