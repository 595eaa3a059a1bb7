"""bf16 trunk fidelity on the real all-MiniLM-L6-v2: cosine vs fp32 >= 0.999."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_THREADS
from factories.texts import PARITY_TEXTS, embed_matrix

from cenote import LLM

MIN_COSINE_BF16 = 0.999


@pytest.fixture(scope="module")
def llm_bf16() -> LLM:
    return LLM(dtype="bfloat16", num_threads=NUM_THREADS)


def test_bf16_runs_the_trunk_in_bf16(llm_bf16) -> None:
    assert llm_bf16.config.model.dtype == torch.bfloat16
    dtypes = {p.dtype for p in llm_bf16.engine.model.parameters()}
    assert dtypes == {torch.bfloat16}
    (out,) = llm_bf16.embed("hello world")
    assert out.outputs.data.dtype == torch.float32  # heads run in fp32
    assert abs(float(out.outputs.data.norm()) - 1.0) < 1e-5


def test_bf16_matches_fp32(llm_bf16, llm_fp32, st_embeddings) -> None:
    ours_bf16 = embed_matrix(llm_bf16, PARITY_TEXTS, truncate_prompt_tokens=-1)
    ours_fp32 = embed_matrix(llm_fp32, PARITY_TEXTS, truncate_prompt_tokens=-1)
    for name, reference in (
        ("sentence-transformers fp32", st_embeddings),
        ("cenote fp32", ours_fp32),
    ):
        cos = F.cosine_similarity(ours_bf16, reference, dim=-1)
        worst = int(cos.argmin())
        assert cos.min() >= MIN_COSINE_BF16, (
            f"bf16 vs {name}: min cosine {cos.min():.5f} on {PARITY_TEXTS[worst][:60]!r}"
        )
    # bf16 must actually differ from fp32, or this test is not testing bf16
    assert (ours_bf16 - ours_fp32).abs().max() > 1e-5
