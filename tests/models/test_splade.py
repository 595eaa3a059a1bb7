"""Sparse (SPLADE) embeddings: BertForMaskedLM / DistilBertForMaskedLM + SpladePooling vs
sentence-transformers' SparseEncoder and transformers' MLM logits on tiny random models, fp32;
top-k pruning, decoded tokens, batch invariance, bad input and bad checkpoints."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from factories.encoders import make_model
from factories.st_folders import save_sparse_encoder
from factories.texts import random_prompts
from safetensors.torch import load_file, save_file

from cenote import LLM, PoolingParams
from cenote.errors import InvalidInputError, UnsupportedTaskError
from cenote.models.formats.st_config import SparsePoolingConfig, load_st_config

NUM_THREADS = 2
ATOL = 1e-4  # DESIGN.md §3: vs transformers, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs sentence-transformers, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
TEXTS = [
    "the cat sat",
    "a dog",
    "yes no yes",
    "the mat + the cat - a dog",
    "query document w50 w51 w52",
    "unknownword the",
    " ".join(["cat", "dog", "the", "mat"] * 40),  # longer than one 128-row chunk
]
# (family, SpladePooling strategy, activation)
VARIANTS = [
    ("bert", "max", "relu"),
    ("bert", "sum", "log1p_relu"),
    ("distilbert", "max", "relu"),
    ("distilbert", "sum", "relu"),
]


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_threads=NUM_THREADS, **kwargs)


@pytest.fixture(scope="module")
def masked_lms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """One raw transformers masked LM per family."""
    models = {}
    for seed, family in enumerate(("bert", "distilbert")):
        raw = tmp_path_factory.mktemp(f"{family}-mlm")
        models[family] = raw, make_model(raw, family, "ForMaskedLM", seed=seed)
    return models


@pytest.fixture(scope="module", params=VARIANTS, ids=["-".join(v) for v in VARIANTS])
def splade(request: pytest.FixtureRequest, masked_lms, tmp_path_factory):
    family, strategy, activation = request.param
    raw, model = masked_lms[family]
    folder = save_sparse_encoder(raw, tmp_path_factory.mktemp("splade"), strategy, activation)
    return folder, model, strategy, activation


def _dense(outputs) -> torch.Tensor:
    return torch.stack([out.outputs.data for out in outputs])


def test_sparse_embeddings_match_sparse_encoder(splade) -> None:
    from sentence_transformers import SparseEncoder

    folder, _, strategy, activation = splade
    assert load_st_config(folder).sparse_pooling == SparsePoolingConfig(strategy, activation)
    torch.set_num_threads(NUM_THREADS)
    encoder = SparseEncoder(str(folder), device="cpu").eval()
    theirs = encoder.encode(TEXTS, convert_to_tensor=True).to_dense().float()
    llm = _llm(folder)
    assert llm.supported_tasks == ("embed_sparse",)
    outputs = llm.embed_sparse(TEXTS, use_tqdm=False)
    ours = _dense(outputs)
    assert ours.shape == theirs.shape == (len(TEXTS), 128)
    cos = F.cosine_similarity(ours, theirs, dim=-1)
    assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f}"
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    for out, row in zip(outputs, ours, strict=True):
        # pairs: the active entries, largest first; weights >= 0
        assert out.outputs.num_active == int((row > 0).sum()) > 0
        weights = out.outputs.weights
        assert weights == sorted(weights, reverse=True) and min(weights) > 0
        assert [row[i].item() for i in out.outputs.token_ids] == weights
    # the same tokens as sentence-transformers
    features = encoder.preprocess(TEXTS)
    for out, ids, mask in zip(
        outputs, features["input_ids"], features["attention_mask"], strict=True
    ):
        assert out.prompt_token_ids == ids[mask.bool()].tolist()


def test_sparse_weights_match_transformers_mlm_logits(splade) -> None:
    """log1p(relu(logits)) pooled over the tokens, by hand from transformers' MLM logits."""
    folder, model, strategy, activation = splade
    prompts = random_prompts([1, 5, 40, 200], seed=4)
    outputs = _llm(folder).embed_sparse([{"prompt_token_ids": p} for p in prompts])
    torch.set_num_threads(NUM_THREADS)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0]  # [len, vocab]
        x = torch.log1p(torch.relu(logits))
        if activation == "log1p_relu":
            x = torch.log1p(x)
        expected = x.amax(0) if strategy == "max" else x.sum(0)
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_batch_invariance(splade) -> None:
    folder = splade[0]
    llm = _llm(folder)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 17, 3, 140, 9], seed=5)]
    together = _dense(llm.embed_sparse(prompts, use_tqdm=False))
    for prompt, batched in zip(prompts, together, strict=True):
        alone = _dense(llm.embed_sparse([prompt], use_tqdm=False))[0]
        torch.testing.assert_close(batched, alone, atol=BATCH_ATOL, rtol=0)


@pytest.fixture(scope="module")
def bert_splade(masked_lms, tmp_path_factory) -> Path:
    raw, _ = masked_lms["bert"]
    return save_sparse_encoder(raw, tmp_path_factory.mktemp("bert-splade"))


@pytest.fixture(scope="module")
def bert_llm(bert_splade: Path) -> LLM:
    return _llm(bert_splade)


def test_top_k_pruning_and_decoded_tokens_match_sparse_encoder(bert_splade, bert_llm) -> None:
    from sentence_transformers import SparseEncoder

    torch.set_num_threads(NUM_THREADS)
    encoder = SparseEncoder(str(bert_splade), device="cpu").eval()
    k = 5
    theirs = encoder.encode(TEXTS, convert_to_tensor=True, max_active_dims=k)
    outputs = bert_llm.embed_sparse(TEXTS, max_active_dims=k, return_tokens=True)
    torch.testing.assert_close(_dense(outputs), theirs.to_dense(), atol=ATOL, rtol=0)
    sparse = outputs[0].outputs.to_sparse()  # SparseEncoder's form
    torch.testing.assert_close(
        sparse.coalesce().values(), theirs[0].coalesce().values(), atol=ATOL, rtol=0
    )
    decoded = encoder.decode(theirs, top_k=k)
    for out, expected in zip(outputs, decoded, strict=True):
        assert out.outputs.num_active == k
        assert out.outputs.tokens == [token for token, _ in expected]
        assert len(out.outputs.pairs) == k
    # per-request params, and the same through encode(pooling_task="embed_sparse")
    params = [PoolingParams(max_active_dims=2), PoolingParams()]
    pruned, full = bert_llm.encode(TEXTS[:2], params, pooling_task="embed_sparse")
    assert pruned.outputs.data.shape == (128,)  # the vocabulary, zero outside the top 2
    assert torch.count_nonzero(pruned.outputs.data) == 2
    (alone,) = bert_llm.embed_sparse(TEXTS[1])
    torch.testing.assert_close(full.outputs.data, alone.outputs.data)


def test_model_default_max_active_dims(bert_splade: Path, tmp_path: Path) -> None:
    """config_sentence_transformers.json's max_active_dims is the default top-k."""
    from sentence_transformers import SparseEncoder

    folder = tmp_path / "pruned"
    shutil.copytree(bert_splade, folder)
    settings_path = folder / "config_sentence_transformers.json"
    settings = json.loads(settings_path.read_text())
    settings_path.write_text(json.dumps({**settings, "max_active_dims": 3}))
    torch.set_num_threads(NUM_THREADS)
    theirs = SparseEncoder(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    outputs = _llm(folder).embed_sparse(TEXTS)
    assert all(out.outputs.num_active == 3 for out in outputs)
    torch.testing.assert_close(_dense(outputs), theirs.to_dense(), atol=ATOL, rtol=0)


def test_legacy_splade_folder(bert_splade: Path, tmp_path: Path) -> None:
    """SPLADE folders saved by sentence-transformers 5: MLMTransformer + SpladePooling with
    word_embedding_dimension."""
    folder = tmp_path / "legacy"
    shutil.copytree(bert_splade, folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["type"] = "sentence_transformers.sparse_encoder.models.MLMTransformer"
    modules[1]["type"] = "sentence_transformers.sparse_encoder.models.SpladePooling"
    (folder / "modules.json").write_text(json.dumps(modules))
    pooling = {"pooling_strategy": "sum", "activation_function": "relu"}
    pooling["word_embedding_dimension"] = 128
    (folder / "1_SpladePooling" / "config.json").write_text(json.dumps(pooling))
    assert load_st_config(folder).sparse_pooling == SparsePoolingConfig("sum", "relu")


def test_bad_requests_are_refused(bert_llm: LLM) -> None:
    with pytest.raises(UnsupportedTaskError, match="it supports embed_sparse"):
        bert_llm.embed("the cat")
    with pytest.raises(ValueError, match="max_active_dims must be a positive integer"):
        bert_llm.embed_sparse("the cat", max_active_dims=0)
    with pytest.raises(ValueError, match="max_active_dims must be a positive integer"):
        PoolingParams(max_active_dims=True)
    (out,) = bert_llm.embed_sparse("the cat", max_active_dims=10_000)  # more than the vocabulary
    assert out.outputs.num_active == int((out.outputs.data > 0).sum())


def test_max_active_dims_is_refused_for_dense_tasks(tmp_path: Path) -> None:
    make_model(tmp_path, "distilbert", seed=3)
    llm = _llm(tmp_path)
    with pytest.raises(InvalidInputError, match="max_active_dims applies to sparse embeddings"):
        llm.embed("the cat", PoolingParams(max_active_dims=4))


def test_unsupported_splade_pooling_is_refused(bert_splade: Path, tmp_path: Path) -> None:
    folder = tmp_path / "mean"
    shutil.copytree(bert_splade, folder)
    pooling = {"pooling_strategy": "mean", "activation_function": "relu"}
    (folder / "1_SpladePooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ValueError, match="unsupported SpladePooling.*'mean'"):
        _llm(folder)


# ---- bad checkpoints ---------------------------------------------------------------------------


def _edited(source: Path, target: Path, edit) -> Path:
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


@pytest.mark.parametrize(
    ("family", "name"),
    [
        ("bert", "cls.predictions.transform.dense.weight"),
        ("bert", "cls.predictions.bias"),
        ("distilbert", "vocab_projector.bias"),
        ("distilbert", "vocab_layer_norm.weight"),
    ],
)
def test_a_missing_head_tensor_is_named(masked_lms, family: str, name: str, tmp_path) -> None:
    raw, _ = masked_lms[family]
    folder = _edited(raw, tmp_path / "bad", lambda tensors: tensors.pop(name))
    with pytest.raises(ValueError, match=f"lacks 1 parameters.*'{name}'"):
        _llm(folder)


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_an_unexpected_tensor_is_named(masked_lms, family: str, tmp_path) -> None:
    raw, _ = masked_lms[family]

    def add(tensors: dict) -> None:
        tensors["cls.predictions.extra.weight"] = torch.zeros(2, 2)

    folder = _edited(raw, tmp_path / "bad", add)
    with pytest.raises(ValueError, match=r"'cls\.predictions\.extra\.weight' has no place"):
        _llm(folder)


def test_pretraining_checkpoint_with_untied_decoder_copies_loads(masked_lms, tmp_path) -> None:
    """BERT pre-training checkpoints also hold the next-sentence head and the (tied) decoder:
    accepted and unused, as transformers does."""
    raw, model = masked_lms["bert"]

    def add(tensors: dict) -> None:
        tensors["cls.seq_relationship.weight"] = torch.zeros(2, 32)
        tensors["cls.seq_relationship.bias"] = torch.zeros(2)
        tensors["cls.predictions.decoder.weight"] = tensors[
            "bert.embeddings.word_embeddings.weight"
        ].clone()
        tensors["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"].clone()

    folder = _edited(raw, tmp_path / "pretraining", add)
    prompt = random_prompts([9], seed=6)[0]
    (out,) = _llm(folder).embed_sparse({"prompt_token_ids": prompt})
    with torch.no_grad():
        expected = torch.log1p(torch.relu(model(torch.tensor([prompt])).logits[0])).amax(0)
    torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_score_is_the_dot_product_as_sparse_encoder(bert_splade: Path, bert_llm: LLM) -> None:
    from sentence_transformers import SparseEncoder

    torch.set_num_threads(NUM_THREADS)
    encoder = SparseEncoder(str(bert_splade), device="cpu").eval()
    query, documents = TEXTS[0], TEXTS[1:]
    q = encoder.encode([query], convert_to_tensor=True)
    d = encoder.encode(documents, convert_to_tensor=True)
    expected = encoder.similarity(q, d)[0]  # dot product (SparseEncoder's default)
    got = torch.tensor([out.outputs.score for out in bert_llm.score(query, documents)])
    torch.testing.assert_close(got, expected.float(), atol=ATOL, rtol=0)


def test_bf16_trunk_matches_fp32(bert_splade: Path, bert_llm: LLM) -> None:
    """bf16 trunk, fp32 MLM head: cosine vs fp32 >= 0.999 (as tests/models/test_bf16.py)."""
    llm_bf16 = LLM(str(bert_splade), dtype="bfloat16", num_threads=NUM_THREADS)
    bf16 = _dense(llm_bf16.embed_sparse(TEXTS, use_tqdm=False))
    cos = F.cosine_similarity(bf16, _dense(bert_llm.embed_sparse(TEXTS, use_tqdm=False)))
    assert bf16.dtype == torch.float32  # the head runs in fp32
    assert cos.min() >= 0.999, f"min cosine {cos.min():.5f}"
