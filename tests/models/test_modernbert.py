"""ModernBERT vs transformers and sentence-transformers on tiny random models, fp32.

Local layers see 4 tokens on either side (``local_attention=8``), so prompts longer than 5
tokens exercise the window; layers alternate global and local (``global_attn_every_n_layers=2``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_THREADS
from factories.encoder_zoo import TEXTS, make_modernbert
from factories.st_folders import save_sentence_transformer
from factories.texts import random_prompts

from cenote import LLM, PoolingParams
from cenote.errors import UnknownArchitectureError

ATOL = 1e-4  # DESIGN.md §3: hidden states / logits vs transformers, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs sentence-transformers, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
LENGTHS = [1, 4, 5, 6, 9, 9, 30, 100]


@pytest.fixture(scope="module")
def trunk(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("modernbert")
    return folder, make_modernbert(folder, seed=1)


@pytest.fixture(scope="module")
def trunk_llm(trunk) -> LLM:
    return LLM(str(trunk[0]), dtype="float32", num_threads=NUM_THREADS)


def _token_embed(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    outputs = llm.encode(
        [{"prompt_token_ids": p} for p in prompts],
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    return [out.outputs.data for out in outputs]


def test_hidden_states_match_transformers(trunk, trunk_llm) -> None:
    _, reference = trunk
    prompts = random_prompts(LENGTHS, seed=3)
    for prompt, ours in zip(prompts, _token_embed(trunk_llm, prompts), strict=True):
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        assert ours.shape == expected.shape
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_local_window_matters(trunk, trunk_llm) -> None:
    """Without the window (every token in reach) a long prompt's hidden states change: the
    parity above really exercises local attention."""
    (prompt,) = random_prompts([30], seed=4)
    wide = LLM(
        str(trunk[0]), dtype="float32", num_threads=NUM_THREADS,
        hf_overrides={"local_attention": 1000},
    )  # fmt: skip
    (local,), (everywhere,) = _token_embed(trunk_llm, [prompt]), _token_embed(wide, [prompt])
    assert (local - everywhere).abs().max() > 1e-2


def test_batch_invariance(trunk_llm) -> None:
    prompts = random_prompts(LENGTHS, seed=5)
    together = _token_embed(trunk_llm, prompts)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _token_embed(trunk_llm, [prompt])
        torch.testing.assert_close(batched, alone, atol=BATCH_ATOL, rtol=0)


def test_embeddings_match_sentence_transformers(trunk, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = save_sentence_transformer(
        trunk[0], tmp_path / "st", "mean", dense=[(32, 16, True)], max_seq_length=64
    )
    torch.set_num_threads(NUM_THREADS)
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    ours = torch.stack([o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)])
    assert ours.shape == expected.shape == (len(TEXTS), 16)
    cos = F.cosine_similarity(ours, expected.float(), dim=-1)
    assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f}"


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_cross_encoder_matches_sentence_transformers(pooling: str, tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    raw = tmp_path / "raw"
    make_modernbert(
        raw, "ForSequenceClassification", seed=2, num_labels=1, classifier_pooling=pooling
    )
    saved = tmp_path / "cross"
    CrossEncoder(str(raw), device="cpu").save(str(saved))
    pairs = [(TEXTS[0], t) for t in TEXTS[1:]]
    torch.set_num_threads(NUM_THREADS)
    expected = CrossEncoder(str(saved), device="cpu").predict(pairs, batch_size=8)
    llm = LLM(str(saved), dtype="float32", num_threads=NUM_THREADS)
    scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    np.testing.assert_allclose(scores, expected, atol=ATOL, rtol=0)


def test_classifier_logits_match_transformers(tmp_path: Path) -> None:
    reference = make_modernbert(
        tmp_path, "ForSequenceClassification", seed=6, num_labels=3, classifier_pooling="mean"
    )
    llm = LLM(str(tmp_path), dtype="float32", num_threads=NUM_THREADS)
    prompts = random_prompts([3, 12, 40], seed=7)
    outputs = llm.classify(
        [{"prompt_token_ids": p} for p in prompts], PoolingParams(use_activation=False),
        use_tqdm=False,
    )  # fmt: skip
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def _edit_config(source: Path, target: Path, **entries) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(entries)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_unsupported_variants_are_refused_at_load(trunk, tmp_path: Path) -> None:
    folder = _edit_config(
        trunk[0],
        tmp_path / "yarn",
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    with pytest.raises(ValueError, match=r"rope_type 'yarn' is not supported; supported: default"):
        LLM(str(folder), dtype="float32")
    folder = _edit_config(trunk[0], tmp_path / "chunked", layer_types=["chunked_attention"] * 4)
    with pytest.raises(ValueError, match="full_attention, sliding_attention"):
        LLM(str(folder), dtype="float32")
    folder = _edit_config(trunk[0], tmp_path / "mlm", architectures=["ModernBertForMaskedLM"])
    with pytest.raises(UnknownArchitectureError, match="ModernBertForSequenceClassification"):
        LLM(str(folder), dtype="float32")
