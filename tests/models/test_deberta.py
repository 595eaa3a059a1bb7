"""DeBERTa-v2 / v3 vs transformers and sentence-transformers on tiny random models, fp32:
hidden states (atol 1e-4), sentence embeddings (cosine >= 0.9999), classifier logits and
probabilities, cross-encoder scores, batch invariance (1e-5), bf16 vs fp32 and checkpoints
with a missing, an unexpected, an ignored or a prefixed tensor.

Variants (tests/factories/encoders.py ``deberta-v2`` plus overrides), each with prompts longer
than its relative-position range so that buckets and clamping are exercised:

- ``v3``: deberta-v3 / mxbai-rerank-v1's settings: 8 log buckets over 256 positions, shared
  key projections, a layer-normed position table, no absolute positions, no token types;
- ``v2``: deberta-v2-xlarge's: no buckets, distances clamped at 16, own ``pos_key_proj`` /
  ``pos_query_proj``, absolute positions, two token types, the convolution after the first
  layer, and embeddings narrower than the hidden size (``embed_proj``);
- ``c2p``: content-to-position only, 8 buckets over 20 positions, own projections;
- ``absolute``: no relative attention (BERT-like, the varlen kernel path).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_THREADS
from factories.encoders import make_model
from factories.seeded import set_config
from factories.st_folders import save_cross_encoder, save_sentence_transformer
from factories.texts import random_prompts
from safetensors.torch import load_file, save_file

from cenote import LLM, PoolingParams
from cenote.models.deberta_v2 import log_bucket

ATOL = 1e-4  # DESIGN.md §3: hidden states / logits vs transformers, fp32
PROBS_ATOL = 1e-5  # DESIGN.md §3: classifier probabilities, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs sentence-transformers, fp32
MIN_COSINE_BF16 = 0.999  # tests/models/test_bf16.py's bound
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
VARIANTS: dict[str, dict] = {
    "v3": {},
    "v2": dict(
        position_buckets=0,
        max_relative_positions=16,
        share_att_key=False,
        position_biased_input=True,
        norm_rel_ebd="none",
        type_vocab_size=2,
        conv_kernel_size=3,
        conv_act="gelu",
        embedding_size=16,
    ),
    "c2p": dict(position_buckets=8, max_relative_positions=20, pos_att_type=["c2p"]),
    "absolute": dict(relative_attention=False, position_biased_input=True),
}
# past the exact distances (4), the clamps (16, 20) and the log buckets' range
LENGTHS = [1, 3, 5, 9, 17, 40, 150, 17]
TEXTS = [
    "the cat sat",
    "a dog",
    "yes no yes",
    "the mat + the cat - a dog",
    "query document",
    "unknownword the",
    " ".join(["cat", "dog", "the", "mat"] * 30),
]
QUERY = "the cat sat on the mat"
DOCUMENTS = ["a cat sat", "dog", "the mat w40 w41 w42 w43 yes no " * 3, "query document"]


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_threads=NUM_THREADS, **kwargs)


def _token_embeddings(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    outputs = llm.encode(
        [{"prompt_token_ids": p} for p in prompts],
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    return [out.outputs.data.float() for out in outputs]


def _hidden(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).last_hidden_state[0]


@pytest.fixture(scope="module", params=list(VARIANTS))
def trunk(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(f"deberta-{request.param}")
    model = make_model(folder, "deberta-v2", seed=3, **VARIANTS[request.param])
    return folder, model, _llm(folder)


def test_hidden_states_match_transformers(trunk) -> None:
    _, model, llm = trunk
    assert llm.supported_tasks == ("embed", "token_embed")
    prompts = random_prompts(LENGTHS, seed=11)
    torch.set_num_threads(NUM_THREADS)
    for prompt, ours in zip(prompts, _token_embeddings(llm, prompts), strict=True):
        expected = _hidden(model, prompt)
        assert ours.shape == expected.shape == (len(prompt), 32)
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_batch_invariance(trunk) -> None:
    _, _, llm = trunk
    prompts = random_prompts(LENGTHS, seed=12)
    together = _token_embeddings(llm, prompts)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _token_embeddings(llm, [prompt])
        torch.testing.assert_close(batched, alone, atol=BATCH_ATOL, rtol=0)


def test_embeddings_match_sentence_transformers(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    make_model(tmp_path / "raw", "deberta-v2", seed=4)
    folder = save_sentence_transformer(tmp_path / "raw", tmp_path / "st", "mean", normalize=False)
    torch.set_num_threads(NUM_THREADS)
    st_model = SentenceTransformer(str(folder), device="cpu").float().eval()
    theirs = st_model.encode(TEXTS, convert_to_tensor=True).float()
    llm = _llm(folder)
    outputs = llm.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    ours = torch.stack([out.outputs.data.float() for out in outputs])
    assert ours.shape == theirs.shape == (len(TEXTS), 32)
    cos = F.cosine_similarity(ours, theirs, dim=-1)
    assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f}"
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    features = st_model.preprocess(TEXTS)  # the same tokens as sentence-transformers
    for out, ids, mask in zip(
        outputs, features["input_ids"], features["attention_mask"], strict=True
    ):
        assert out.prompt_token_ids == ids[mask.bool()].tolist()


@pytest.mark.parametrize("variant", ["v3", "v2"])
def test_classifier_matches_transformers(variant: str, tmp_path: Path) -> None:
    """ContextPooler (dense + GELU on the first token) and the classifier: logits and
    softmax probabilities."""
    model = make_model(
        tmp_path, "deberta-v2", "ForSequenceClassification", seed=5, num_labels=3,
        **VARIANTS[variant],
    )  # fmt: skip
    llm = _llm(tmp_path)
    assert llm.supported_tasks == ("classify",)
    prompts = random_prompts([5, 1, 30, 140], seed=13)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    raw = llm.classify(inputs, PoolingParams(use_activation=False), use_tqdm=False)
    probs = llm.classify(inputs, use_tqdm=False)
    for prompt, logits, out in zip(prompts, raw, probs, strict=True):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits.outputs.data, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(
            torch.tensor(out.outputs.probs), expected.softmax(-1), atol=PROBS_ATOL, rtol=0
        )


@pytest.mark.parametrize("variant", ["v3", "v2"])
def test_cross_encoder_scores_match_sentence_transformers(variant: str, tmp_path: Path) -> None:
    """Query-document pairs; ``v2`` has token types, so the second segment's ids must reach
    the model as sentence-transformers hands them."""
    from sentence_transformers import CrossEncoder

    raw = tmp_path / "raw"
    make_model(raw, "deberta-v2", "ForSequenceClassification", seed=7, num_labels=1,
               **VARIANTS[variant])  # fmt: skip
    saved = save_cross_encoder(raw, tmp_path / "cross")
    torch.set_num_threads(NUM_THREADS)
    expected = CrossEncoder(str(saved), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    llm = _llm(saved)
    got = np.array([o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)])
    np.testing.assert_allclose(got, expected, atol=PROBS_ATOL, rtol=0)  # sigmoid probabilities


def test_bf16_trunk_matches_fp32(tmp_path: Path) -> None:
    """The bf16 trunk keeps the embeddings: cosine vs fp32 >= 0.999 (tests/models/test_bf16.py)."""
    make_model(tmp_path / "raw", "deberta-v2", seed=6)
    folder = save_sentence_transformer(tmp_path / "raw", tmp_path / "st", "mean")
    fp32 = _llm(folder).embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    llm_bf16 = LLM(str(folder), dtype="bfloat16", num_threads=NUM_THREADS)
    assert {p.dtype for p in llm_bf16.engine.model.parameters()} == {torch.bfloat16}
    bf16 = llm_bf16.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    ours, reference = (torch.stack([o.outputs.data for o in run]) for run in (bf16, fp32))
    cos = F.cosine_similarity(ours, reference)
    assert cos.min() >= MIN_COSINE_BF16, f"min cosine {cos.min():.5f}"
    assert (ours - reference).abs().max() > 1e-5  # bf16 really ran


@pytest.mark.parametrize(("buckets", "max_position"), [(8, 20), (8, 256), (256, 512)])
def test_log_buckets_match_transformers(buckets: int, max_position: int) -> None:
    """deberta-v3's own sizes (256 buckets over 512 positions) too, past the table's end."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    relative = torch.arange(-2000, 2001)
    expected = make_log_bucket_position(relative, buckets, max_position).long()
    assert torch.equal(log_bucket(relative, buckets, max_position), expected)


def test_pos_att_type_as_a_string(tmp_path: Path) -> None:
    """Hub configs write ``"pos_att_type": "p2c|c2p"`` (transformers splits it on load)."""
    model = make_model(tmp_path, "deberta-v2", seed=8)
    set_config(tmp_path, pos_att_type="P2C | c2p")
    (prompt,) = random_prompts([40], seed=14)
    (ours,) = _token_embeddings(_llm(tmp_path), [prompt])
    torch.testing.assert_close(ours, _hidden(model, prompt), atol=ATOL, rtol=0)


# ---- checkpoints -------------------------------------------------------------------------------


def _edit_checkpoint(source: Path, target: Path, edit) -> Path:
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


@pytest.mark.parametrize(
    "name",
    [
        "encoder.layer.1.attention.self.pos_query_proj.bias",
        "encoder.layer.0.attention.self.key_proj.weight",
        "encoder.rel_embeddings.weight",
        "encoder.conv.conv.weight",
    ],
)
def test_a_missing_tensor_is_named(name: str, tmp_path: Path) -> None:
    make_model(tmp_path / "ok", "deberta-v2", seed=1, **VARIANTS["v2"])
    folder = _edit_checkpoint(tmp_path / "ok", tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(ValueError, match="lacks 1 parameters.*" + re.escape(name)):
        _llm(folder)


def test_an_unexpected_tensor_is_named(tmp_path: Path) -> None:
    make_model(tmp_path / "ok", "deberta-v2", seed=1)

    def add(tensors: dict) -> None:  # v3 shares key projections: no pos_key_proj
        tensors["encoder.layer.0.attention.self.pos_key_proj.weight"] = torch.zeros(32, 32)

    folder = _edit_checkpoint(tmp_path / "ok", tmp_path / "bad", add)
    with pytest.raises(ValueError, match=r"'encoder\.layer\.0\.attention\.self\.pos_key_proj"):
        _llm(folder)


def test_prefixed_checkpoint_with_an_unused_position_table_loads(tmp_path: Path) -> None:
    """A trunk saved under ``deberta.`` with an absolute position table its config does not
    use (transformers ignores it) loads and gives transformers' hidden states."""
    model = make_model(tmp_path / "ok", "deberta-v2", seed=2)

    def edit(tensors: dict) -> None:
        for name in list(tensors):
            tensors[f"deberta.{name}"] = tensors.pop(name)
        tensors["deberta.embeddings.position_embeddings.weight"] = torch.ones(256, 32)

    folder = _edit_checkpoint(tmp_path / "ok", tmp_path / "prefixed", edit)
    (prompt,) = random_prompts([12], seed=3)
    (ours,) = _token_embeddings(_llm(folder), [prompt])
    torch.testing.assert_close(ours, _hidden(model, prompt), atol=ATOL, rtol=0)
