"""cenote vs sentence-transformers on the real all-MiniLM-L6-v2, fp32: cosine >= 0.9999."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from factories.texts import PARITY_TEXTS, embed_matrix

MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3


def test_corpus_is_varied_and_includes_texts_over_the_limit(llm_fp32) -> None:
    assert len(PARITY_TEXTS) >= 50
    lengths = [len(llm_fp32.tokenizer.encode(t).ids) for t in PARITY_TEXTS]
    limit = llm_fp32.config.model.max_model_len
    assert limit == 256
    assert sum(n > limit for n in lengths) >= 3
    assert min(lengths) <= 4


def test_embeddings_match_sentence_transformers(llm_fp32, st_embeddings) -> None:
    ours = embed_matrix(llm_fp32, PARITY_TEXTS, truncate_prompt_tokens=-1)
    assert ours.shape == st_embeddings.shape == (len(PARITY_TEXTS), 384)
    cos = F.cosine_similarity(ours, st_embeddings, dim=-1)
    worst = int(cos.argmin())
    assert cos.min() >= MIN_COSINE_FP32, (
        f"min cosine {cos.min():.6f} on text {worst}: {PARITY_TEXTS[worst][:60]!r}"
    )
    # both pipelines end with Normalize
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(ours)), atol=1e-5, rtol=0)


def test_truncation_matches_sentence_transformers_token_for_token(llm_fp32, st_model) -> None:
    long_texts = [t for t in PARITY_TEXTS if len(llm_fp32.tokenizer.encode(t).ids) > 256]
    outputs = llm_fp32.embed(long_texts, truncate_prompt_tokens=-1)
    features = st_model.preprocess(long_texts)
    for out, ids, mask in zip(
        outputs, features["input_ids"], features["attention_mask"], strict=True
    ):
        assert out.prompt_token_ids == ids[mask.bool()].tolist()
        assert len(out.prompt_token_ids) == 256


def test_single_prompt_and_token_id_prompt_match(llm_fp32, st_embeddings) -> None:
    text = PARITY_TEXTS[5]
    (by_text,) = llm_fp32.embed(text)
    ids = llm_fp32.tokenizer.encode(text).ids
    (by_ids,) = llm_fp32.embed({"prompt_token_ids": ids})
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    torch.testing.assert_close(by_text.outputs.data, by_ids.outputs.data, atol=1e-6, rtol=0)
    cos = F.cosine_similarity(by_text.outputs.data, st_embeddings[5], dim=0)
    assert cos >= MIN_COSINE_FP32
