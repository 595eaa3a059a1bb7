"""MPNet and DistilBERT vs transformers and sentence-transformers on tiny random models, fp32:
hidden states (atol 1e-4), sentence embeddings (cosine >= 0.9999), cross-encoder scores,
batch invariance (1e-5) and checkpoints with a missing or an unexpected tensor."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from factories.encoders import make_model
from factories.st_folders import save_cross_encoder, save_sentence_transformer
from factories.texts import random_prompts
from safetensors.torch import load_file, save_file

from cenote import LLM, PoolingParams

NUM_THREADS = 2
ATOL = 1e-4  # DESIGN.md §3: hidden states vs transformers, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs sentence-transformers, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
FAMILIES = ["mpnet", "distilbert"]
# lengths past MPNet's exact buckets (8), its log buckets and max_distance (128)
LENGTHS = [1, 3, 9, 17, 40, 3, 150, 17]
TEXTS = [
    "the cat sat",
    "a dog",
    "yes no yes",
    "the mat + the cat - a dog",
    "query document",
    "unknownword the",
    " ".join(["cat", "dog", "the", "mat"] * 40),
]
QUERY = "the cat sat on the mat"
DOCUMENTS = ["a cat sat", "dog", "the mat w40 w41 w42 w43 yes no", "query document"]


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_threads=NUM_THREADS, **kwargs)


@pytest.fixture(scope="module", params=FAMILIES)
def trunk(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    model = make_model(folder, request.param, seed=3)
    return request.param, folder, model


def _token_embeddings(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    outputs = llm.encode(
        [{"prompt_token_ids": p} for p in prompts],
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    return [out.outputs.data.float() for out in outputs]


def test_hidden_states_match_transformers(trunk) -> None:
    family, folder, model = trunk
    llm = _llm(folder)
    assert llm.supported_tasks == ("embed", "token_embed")
    limit = llm.config.model.max_model_len
    assert limit == 256  # MPNet: 258 positions, the first two before padding_idx + 1
    prompts = random_prompts(LENGTHS, seed=11)
    torch.set_num_threads(NUM_THREADS)
    for prompt, ours in zip(prompts, _token_embeddings(llm, prompts), strict=True):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).last_hidden_state[0]
        assert ours.shape == expected.shape == (len(prompt), 32)
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_batch_invariance(trunk) -> None:
    _, folder, _ = trunk
    llm = _llm(folder)
    prompts = random_prompts(LENGTHS, seed=12)
    together = _token_embeddings(llm, prompts)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _token_embeddings(llm, [prompt])
        torch.testing.assert_close(batched, alone, atol=BATCH_ATOL, rtol=0)


@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "raw"])
def test_sentence_embeddings_match_sentence_transformers(trunk, normalize, tmp_path) -> None:
    """all-mpnet-base-v2 (mean + Normalize) and msmarco-distilbert (mean) folders."""
    from sentence_transformers import SentenceTransformer

    _, folder, _ = trunk
    st_folder = save_sentence_transformer(folder, tmp_path / "st", "mean", normalize)
    torch.set_num_threads(NUM_THREADS)
    st_model = SentenceTransformer(str(st_folder), device="cpu").float().eval()
    theirs = st_model.encode(TEXTS, convert_to_tensor=True).float()
    llm = _llm(st_folder)
    outputs = llm.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    ours = torch.stack([out.outputs.data.float() for out in outputs])
    assert ours.shape == theirs.shape == (len(TEXTS), 32)
    cos = F.cosine_similarity(ours, theirs, dim=-1)
    assert cos.min() >= MIN_COSINE_FP32, (
        f"min cosine {cos.min():.6f} on {TEXTS[int(cos.argmin())]!r}"
    )
    if not normalize:  # the raw vectors agree too, not only their directions
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    # the same tokens as sentence-transformers
    features = st_model.preprocess(TEXTS)
    for out, ids, mask in zip(
        outputs, features["input_ids"], features["attention_mask"], strict=True
    ):
        assert out.prompt_token_ids == ids[mask.bool()].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def classifier(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    raw = tmp_path_factory.mktemp(f"{request.param}-raw")
    model = make_model(raw, request.param, "ForSequenceClassification", seed=5, num_labels=3)
    return raw, model


def test_sequence_classifier_logits_match_transformers(classifier) -> None:
    raw, model = classifier
    llm = _llm(raw)
    assert llm.supported_tasks == ("classify",)
    prompts = random_prompts([5, 1, 30, 140], seed=13)
    outputs = llm.classify(
        [{"prompt_token_ids": p} for p in prompts], PoolingParams(use_activation=False)
    )
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_cross_encoder_scores_match_sentence_transformers(family: str, tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    raw = tmp_path / "raw"
    make_model(raw, family, "ForSequenceClassification", seed=7, num_labels=1)
    saved = save_cross_encoder(raw, tmp_path / "cross")
    torch.set_num_threads(NUM_THREADS)
    expected = CrossEncoder(str(saved), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    llm = _llm(saved)
    got = np.array([o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)])
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


# ---- bad checkpoints ---------------------------------------------------------------------------


def _edit_checkpoint(source: Path, target: Path, edit) -> Path:
    import shutil

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


@pytest.mark.parametrize(
    ("family", "name"),
    [
        ("mpnet", "encoder.relative_attention_bias.weight"),
        ("mpnet", "encoder.layer.1.attention.attn.k.bias"),
        ("distilbert", "transformer.layer.0.attention.v_lin.weight"),
        ("distilbert", "embeddings.position_embeddings.weight"),
    ],
)
def test_a_missing_tensor_is_named(family: str, name: str, tmp_path: Path) -> None:
    make_model(tmp_path / "ok", family, seed=1)
    folder = _edit_checkpoint(tmp_path / "ok", tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(ValueError, match="lacks 1 parameters.*" + re.escape(name)):
        _llm(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unexpected_tensor_is_named(family: str, tmp_path: Path) -> None:
    make_model(tmp_path / "ok", family, seed=1)

    def add(tensors: dict) -> None:
        tensors["encoder.layer.0.attention.extra_gate.weight"] = torch.zeros(4, 4)

    folder = _edit_checkpoint(tmp_path / "ok", tmp_path / "bad", add)
    with pytest.raises(ValueError, match=r"'encoder\.layer\.0\.attention\.extra_gate\.weight'"):
        _llm(folder)


def test_mpnet_pooler_and_prefixed_checkpoints_load(tmp_path: Path) -> None:
    """MPNetModel's (unused) CLS pooler is accepted; a trunk saved under ``mpnet.`` loads."""
    model = make_model(tmp_path / "ok", "mpnet", seed=2)
    assert "pooler.dense.weight" in load_file(tmp_path / "ok" / "model.safetensors")

    def prefix(tensors: dict) -> None:
        for name in list(tensors):
            tensors[f"mpnet.{name}"] = tensors.pop(name)

    folder = _edit_checkpoint(tmp_path / "ok", tmp_path / "prefixed", prefix)
    prompt = random_prompts([12], seed=3)[0]
    (ours,) = _token_embeddings(_llm(folder), [prompt])
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).last_hidden_state[0]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["MPNetModel"]


def test_bf16_trunk_matches_fp32(trunk, tmp_path: Path) -> None:
    """The bf16 trunk (the default on CPUs with native bf16) keeps the embeddings: cosine vs
    fp32 >= 0.999, as tests/models/test_bf16.py asks of all-MiniLM-L6-v2."""
    _, folder, _ = trunk
    st_folder = save_sentence_transformer(folder, tmp_path / "st", "mean", True)
    fp32 = _llm(st_folder).embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    llm_bf16 = LLM(str(st_folder), dtype="bfloat16", num_threads=NUM_THREADS)
    assert {p.dtype for p in llm_bf16.engine.model.parameters()} == {torch.bfloat16}
    bf16 = llm_bf16.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    cos = F.cosine_similarity(
        torch.stack([o.outputs.data for o in bf16]), torch.stack([o.outputs.data for o in fp32])
    )
    assert cos.min() >= 0.999, f"min cosine {cos.min():.5f}"
