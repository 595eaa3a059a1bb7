"""sentence-transformers Pooling with ``include_prompt=false``: the instruction prompt is fed to
the model but left out of CLS / MEAN pooling. cenote vs SentenceTransformer.encode (which
prepends the default prompt) on tiny random BERT and MPNet models, fp32."""

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

NUM_THREADS = 2
ATOL = 1e-4  # DESIGN.md §3, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs sentence-transformers, fp32
BATCH_ATOL = 1e-5
PROMPTS = {"query": "query the : ", "passage": ""}
TEXTS = [
    "the cat sat",
    "a dog",
    "yes no yes",
    "the mat + the cat - a dog",
    "document",
    " ".join(["cat", "dog", "the", "mat"] * 20),
]


@pytest.fixture(scope="module", params=["bert", "mpnet"])
def trunk(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, make_model(folder, request.param, seed=8)


def _save(trunk, tmp_path: Path, pooling: str, include_prompt: bool, name: str) -> Path:
    folder, _ = trunk
    return save_sentence_transformer(
        folder,
        tmp_path / name,
        pooling,
        normalize=True,
        include_prompt=include_prompt,
        prompts=PROMPTS,
        default_prompt_name="query",
    )


def _embed(folder: Path, texts: list, **kwargs) -> tuple[LLM, torch.Tensor]:
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    outputs = llm.embed(texts, use_tqdm=False, **kwargs)
    return llm, torch.stack([out.outputs.data.float() for out in outputs])


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_prompt_left_out_of_pooling_matches_sentence_transformers(
    trunk, pooling: str, tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    folder = _save(trunk, tmp_path, pooling, include_prompt=False, name="excluded")
    torch.set_num_threads(NUM_THREADS)
    st_model = SentenceTransformer(str(folder), device="cpu").float().eval()
    assert st_model.default_prompt_name == "query"
    theirs = st_model.encode(TEXTS, convert_to_tensor=True).float()
    llm, ours = _embed(folder, TEXTS)
    assert llm.input_processor.instruction_length == 4  # [CLS]/<s>, "query", "the", ":" (unknown)
    cos = F.cosine_similarity(ours, theirs, dim=-1)
    assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f}"
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    # the prompt is still in the model's input: only pooling leaves it out
    included = _save(trunk, tmp_path, pooling, include_prompt=True, name="included")
    _, with_prompt = _embed(included, TEXTS)
    assert F.cosine_similarity(with_prompt, ours, dim=-1).min() < 0.99


def test_mean_equals_mean_of_token_embeddings_after_the_prompt(trunk, tmp_path: Path) -> None:
    folder = _save(trunk, tmp_path, "mean", include_prompt=False, name="excluded")
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    n = llm.input_processor.instruction_length
    unit = PoolingParams(normalize=False)
    for text in TEXTS[:3]:
        (tokens,) = llm.encode(text, unit, pooling_task="token_embed")  # every token
        (pooled,) = llm.embed(text, unit)
        assert tokens.outputs.data.shape[0] == len(pooled.prompt_token_ids) > n
        expected = tokens.outputs.data[n:].mean(0)
        torch.testing.assert_close(pooled.outputs.data, expected, atol=1e-5, rtol=0)
    # token-id prompts carry no instruction: every token is pooled
    ids = llm.tokenizer.encode("the cat sat").ids
    (tokens,) = llm.encode({"prompt_token_ids": ids}, unit, pooling_task="token_embed")
    (pooled,) = llm.embed({"prompt_token_ids": ids}, unit)
    torch.testing.assert_close(pooled.outputs.data, tokens.outputs.data.mean(0), atol=1e-5, rtol=0)


def test_batch_invariance_with_and_without_instructions(trunk, tmp_path: Path) -> None:
    folder = _save(trunk, tmp_path, "mean", include_prompt=False, name="excluded")
    prompts = [*TEXTS, {"prompt_token_ids": [7, 8, 9, 10]}, "a dog"]
    llm, together = _embed(folder, prompts)
    for prompt, batched in zip(prompts, together, strict=True):
        alone = llm.embed([prompt], use_tqdm=False)[0].outputs.data
        torch.testing.assert_close(batched, alone, atol=BATCH_ATOL, rtol=0)


def test_a_prompt_truncated_away_pools_like_sentence_transformers(trunk, tmp_path: Path) -> None:
    """Truncation that leaves only instruction tokens: MEAN gives zeros (no token to average),
    as sentence-transformers does; the request does not fail."""
    folder = _save(trunk, tmp_path, "mean", include_prompt=False, name="excluded")
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    (out,) = llm.embed("the cat sat", PoolingParams(normalize=False), truncate_prompt_tokens=2)
    assert len(out.prompt_token_ids) == 2 < llm.input_processor.instruction_length
    assert torch.count_nonzero(out.outputs.data) == 0


ROLE_PROMPTS = {"query": "query the : ", "document": "document : ", "classification": "mat : "}


@pytest.mark.parametrize("include_prompt", [False, True])
def test_per_request_prompts_match_sentence_transformers(
    trunk, include_prompt: bool, tmp_path: Path
) -> None:
    """``prompt_name`` / ``prompt`` per call, ``embed_query`` / ``embed_documents``: the same
    embeddings as sentence-transformers' ``encode(prompt_name=, prompt=)``, ``encode_query``
    and ``encode_document``; prompts of different requests mix in one batch."""
    from sentence_transformers import SentenceTransformer

    folder, _ = trunk
    saved = save_sentence_transformer(
        folder, tmp_path / "roles", "mean", normalize=True, include_prompt=include_prompt,
        prompts=ROLE_PROMPTS,
    )  # fmt: skip
    torch.set_num_threads(NUM_THREADS)
    st_model = SentenceTransformer(str(saved), device="cpu").float().eval()
    llm = LLM(str(saved), dtype="float32", num_threads=NUM_THREADS)

    def stack(outputs: list) -> torch.Tensor:
        return torch.stack([out.outputs.data.float() for out in outputs])

    cases = {
        "none": (llm.embed(TEXTS, use_tqdm=False), st_model.encode(TEXTS)),
        "name": (
            llm.embed(TEXTS, prompt_name="classification", use_tqdm=False),
            st_model.encode(TEXTS, prompt_name="classification"),
        ),
        "literal": (
            llm.embed(TEXTS, prompt="the dog : ", use_tqdm=False),
            st_model.encode(TEXTS, prompt="the dog : "),
        ),
        "query": (llm.embed_query(TEXTS, use_tqdm=False), st_model.encode_query(TEXTS)),
        "document": (
            llm.embed_documents(TEXTS, use_tqdm=False),
            st_model.encode_document(TEXTS),
        ),
    }
    for case, (ours_out, theirs) in cases.items():
        ours, expected = stack(ours_out), torch.as_tensor(theirs).float()
        cos = F.cosine_similarity(ours, expected, dim=-1)
        assert cos.min() >= MIN_COSINE_FP32, f"{case}: min cosine {cos.min():.6f}"
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0, msg=case)
    assert not torch.allclose(stack(cases["query"][0]), stack(cases["document"][0]), atol=1e-3)
    # one batch, a prompt per request (PoolingParams), as the lone requests give them
    mixed = [PoolingParams(prompt_name="query"), PoolingParams(prompt="the dog : ")] * 3
    together = stack(llm.embed(TEXTS, mixed, use_tqdm=False))
    alone = torch.cat([
        stack(llm.embed(text, params, use_tqdm=False))
        for text, params in zip(TEXTS, mixed, strict=True)
    ])  # fmt: skip
    torch.testing.assert_close(together, alone, atol=BATCH_ATOL, rtol=0)
    torch.testing.assert_close(together[0], stack(cases["query"][0])[0], atol=BATCH_ATOL, rtol=0)


def test_unknown_or_conflicting_prompts_are_refused(trunk, tmp_path: Path) -> None:
    from cenote.errors import InvalidInputError

    folder = _save(trunk, tmp_path, "mean", include_prompt=False, name="excluded")
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    with pytest.raises(InvalidInputError, match=r"prompt_name 'search' is not one of .*'query'"):
        llm.embed("a dog", prompt_name="search", use_tqdm=False)
    with pytest.raises(InvalidInputError, match="not both"):
        PoolingParams(prompt_name="query", prompt="q: ")
    # no 'document' prompt: embed_documents takes 'passage' (empty here), not the default
    (doc,) = llm.embed_documents("a dog", use_tqdm=False)
    (bare,) = llm.embed("a dog", prompt="", use_tqdm=False)
    (default,) = llm.embed("a dog", use_tqdm=False)
    torch.testing.assert_close(doc.outputs.data, bare.outputs.data, atol=0, rtol=0)
    assert not torch.allclose(doc.outputs.data, default.outputs.data, atol=1e-3)
