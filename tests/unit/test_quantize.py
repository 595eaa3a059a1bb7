"""cenote.pooling.quantize against sentence-transformers' quantize_embeddings, bit for bit,
on real MiniLM outputs."""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers.util.quantization import quantize_embeddings as st_quantize

from cenote.errors import InvalidInputError
from cenote.pooling.quantize import quantize_embeddings

TEXTS = ["a cat sits on the mat", "stock prices fell sharply", "how do I bake bread?",
         "the weather is nice today", "quantum computing basics", "a dog runs in the park"]  # fmt: skip


@pytest.fixture(scope="module")
def minilm_vectors(llm_fp32) -> np.ndarray:
    outputs = llm_fp32.embed(TEXTS, use_tqdm=False)
    return np.stack([out.outputs.data.float().numpy() for out in outputs])  # [6, 384]


@pytest.mark.parametrize("precision", ["float32", "int8", "uint8", "binary", "ubinary"])
def test_matches_sentence_transformers(minilm_vectors, precision) -> None:
    ours = quantize_embeddings(minilm_vectors, precision)
    theirs = st_quantize(minilm_vectors, precision)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("precision", ["int8", "uint8"])
def test_ranges_and_calibration_match(minilm_vectors, precision) -> None:
    calibration, rows = minilm_vectors[:4], minilm_vectors[4:]
    ours = quantize_embeddings(rows, precision, calibration_embeddings=calibration)
    assert np.array_equal(ours, st_quantize(rows, precision, calibration_embeddings=calibration))
    ranges = np.vstack((calibration.min(0), calibration.max(0)))
    one = quantize_embeddings(rows[0], precision, ranges=ranges)
    assert np.array_equal(one, st_quantize(rows[0], precision, ranges=ranges))


def test_single_row_without_ranges_is_refused(minilm_vectors) -> None:
    with pytest.raises(InvalidInputError, match="single embedding"):
        quantize_embeddings(minilm_vectors[:1], "int8")
