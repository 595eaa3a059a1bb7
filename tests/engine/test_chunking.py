"""Long inputs chunked instead of cut (``long_input="chunk"``): windows of ``max_model_len``
framed like the whole text, pooled apart and joined (cenote.engine.chunking). The reference is
computed window by window with sentence-transformers' own modules on tiny random BERT folders:
MEAN = the mean over every token of every window, CLS = the token-weighted mean of the windows'
CLS vectors; then normalized."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from factories.encoders import make_model
from factories.st_folders import save_sentence_transformer

from cenote import LLM, PoolingParams
from cenote.engine.chunking import split_windows
from cenote.errors import InvalidInputError

NUM_THREADS = 2
ATOL = 1e-4  # DESIGN.md §3, fp32
MAX_LEN = 32
LONG = " ".join(["the cat sat on the mat", "a dog", "yes no yes"] * 12)  # ~130 tokens
SHORT = "the cat sat"
PROMPTS = {"query": "query the : "}


def test_split_windows_frames_every_window_and_covers_the_body() -> None:
    ids = [101, 7, 8] + list(range(1000, 1020)) + [102]  # [CLS], 2 prompt tokens, body, [SEP]
    windows = split_windows(ids, head=3, tail=1, max_len=10, overlap=2, index=0)
    assert all(w[:3] == [101, 7, 8] and w[-1] == 102 and len(w) <= 10 for w in windows)
    bodies = [w[3:-1] for w in windows]
    assert bodies[0] == list(range(1000, 1006))
    assert all(a[-2:] == b[:2] for a, b in zip(bodies, bodies[1:], strict=False))  # overlap
    assert bodies[-1][-1] == 1019 and len(windows) == 5  # 6 + 4 + 4 + 4 + 2 body tokens
    with pytest.raises(InvalidInputError, match="leaving 6 for text, which must be more than"):
        split_windows(ids, head=3, tail=1, max_len=10, overlap=6, index=4)


@pytest.fixture(scope="module")
def trunk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("trunk")
    make_model(folder, "bert", seed=5)
    return folder


def _folder(trunk: Path, root: Path, pooling: str, include_prompt: bool = True) -> Path:
    return save_sentence_transformer(
        trunk, root / f"{pooling}-{include_prompt}", pooling, normalize=True,
        max_seq_length=MAX_LEN, prompts=PROMPTS, include_prompt=include_prompt,
    )  # fmt: skip


def _reference(folder: Path, text: str, pooling: str, prompt: str, overlap: int) -> torch.Tensor:
    """sentence-transformers' transformer module on each window: [CLS] prompt body [SEP]."""
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(NUM_THREADS)
    st = SentenceTransformer(str(folder), device="cpu").float().eval()
    tokenizer = st.tokenizer
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    body = tokenizer(text, add_special_tokens=False)["input_ids"]
    room = MAX_LEN - 2 - len(prompt_ids)
    include_prompt = st[1].include_prompt
    vectors, weights, tokens, start = [], [], [], 0
    while True:
        ids = [cls, *prompt_ids, *body[start : start + room], sep]
        features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids))}
        with torch.no_grad():
            hidden = st[0](features)["token_embeddings"][0]  # [len, hidden]
        skip = 0 if include_prompt else 1 + len(prompt_ids)
        tokens.append(hidden[skip:])
        vectors.append(hidden[0])
        weights.append(len(ids) - skip)
        if start + room >= len(body):
            break
        start += room - overlap
    if pooling == "mean":
        joined = torch.cat(tokens).mean(0)
    else:
        w = torch.tensor(weights, dtype=torch.float32)
        joined = (torch.stack(vectors) * w[:, None]).sum(0) / w.sum()
    return F.normalize(joined, dim=-1)


@pytest.mark.parametrize(
    ("pooling", "include_prompt", "prompt_name", "overlap"),
    [("mean", True, None, 0), ("mean", False, "query", 5), ("cls", True, "query", 3)],
)
def test_chunked_embedding_equals_the_window_by_window_reference(
    trunk, tmp_path, pooling, include_prompt, prompt_name, overlap
) -> None:
    folder = _folder(trunk, tmp_path, pooling, include_prompt)
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    params = PoolingParams(long_input="chunk", chunk_overlap=overlap, prompt_name=prompt_name)
    long_out, short_out = llm.embed([LONG, SHORT], params, use_tqdm=False)
    prompt = PROMPTS[prompt_name] if prompt_name else ""
    expected = _reference(folder, LONG, pooling, prompt, overlap)
    torch.testing.assert_close(long_out.outputs.data, expected, atol=ATOL, rtol=0)
    assert len(long_out.prompt_token_ids) > MAX_LEN  # usage counts every window's tokens
    # a text that fits is embedded as it always is
    (plain,) = llm.embed(SHORT, PoolingParams(prompt_name=prompt_name), use_tqdm=False)
    torch.testing.assert_close(short_out.outputs.data, plain.outputs.data, atol=1e-6, rtol=0)
    # alone or beside others: the same
    (alone,) = llm.embed(LONG, params, use_tqdm=False)
    torch.testing.assert_close(alone.outputs.data, long_out.outputs.data, atol=1e-5, rtol=0)


def test_without_chunk_a_long_text_is_refused_and_other_tasks_cannot_chunk(trunk, tmp_path) -> None:
    folder = _folder(trunk, tmp_path, "mean")
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    with pytest.raises(InvalidInputError, match="max_model_len"):
        llm.embed(LONG, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="long_input 'chunk' joins"):
        llm.encode(LONG, PoolingParams(long_input="chunk"), pooling_task="token_embed")
    with pytest.raises(InvalidInputError, match="chunk_overlap must be a non-negative"):
        PoolingParams(long_input="chunk", chunk_overlap=-1)
    with pytest.raises(InvalidInputError, match="must be more than chunk_overlap=40"):
        llm.embed(LONG, PoolingParams(long_input="chunk", chunk_overlap=40), use_tqdm=False)


def test_server_defaults_apply_to_embeddings_and_a_request_may_override_them() -> None:
    """``--long-input chunk`` / ``--chunk-overlap``: embeddings only (a classify request keeps
    the 400), a request's own ``long_input`` / ``chunk_overlap`` win, and chunking is not
    undone by ``--auto-truncate``."""
    from cenote.server.protocol import EmbeddingRequest

    plain = EmbeddingRequest(input="a")
    params = plain.to_pooling_params("embed", True, "chunk", 4)
    assert (params.long_input, params.chunk_overlap, params.truncate_prompt_tokens) == (
        "chunk", 4, None,
    )  # fmt: skip
    assert plain.to_pooling_params("classify", True, "chunk", 4).long_input == "error"
    assert plain.to_pooling_params("classify", True, "chunk", 4).truncate_prompt_tokens == -1
    own = EmbeddingRequest(input="a", long_input="error", chunk_overlap=2)
    params = own.to_pooling_params("embed", False, "chunk", 4)
    assert (params.long_input, params.chunk_overlap) == ("error", 2)
    asked = EmbeddingRequest(input="a", long_input="chunk")
    assert asked.to_pooling_params("embed").long_input == "chunk"
