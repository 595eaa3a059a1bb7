"""GTE v1.5 / multilingual (``NewModel``, ``NewForSequenceClassification``) vs transformers'
native ``GteModel`` / ``GteForSequenceClassification`` and sentence-transformers, tiny random
models, fp32.

The reference is transformers 5's own GTE implementation (not code written here): it loads
Alibaba-NLP's remote-code checkpoints by its conversion mapping, and the folders under test are
written in that layout with config.json in the remote code's keys (tests/factories/gte.py).
For NTK-scaled RoPE the reference's inverse frequencies are set from the remote code's formula
(``factories.gte.ntk_inv_freq``), written apart from cenote's ``layers/rotary.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import NUM_THREADS
from factories.encoder_zoo import TEXTS
from factories.gte import make_gte, ntk_inv_freq
from factories.st_folders import save_sentence_transformer
from factories.texts import random_prompts
from safetensors.torch import load_file

from cenote import LLM, PoolingParams
from cenote.models.gte import rope_settings
from cenote.models.layers.rotary import RotaryEmbedding

ATOL = 1e-4  # DESIGN.md §3: hidden states / logits vs transformers, fp32
PROBS_ATOL = 1e-5  # DESIGN.md §3: classifier probabilities, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs sentence-transformers, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
LENGTHS = [1, 3, 17, 17, 60, 200]
# gte-base-en-v1.5 (no token types, plain RoPE); gte-large-en-v1.5 / multilingual (one token
# type, NTK-scaled RoPE)
VARIANTS = {
    "base": dict(),
    "ntk": dict(ntk_factor=2.0, type_vocab_size=1),
}


def _llm(path: Path) -> LLM:
    return LLM(str(path), dtype="float32", num_threads=NUM_THREADS)


def _token_embed(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    outputs = llm.encode(
        [{"prompt_token_ids": p} for p in prompts],
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    return [out.outputs.data.float() for out in outputs]


@pytest.fixture(scope="module", params=list(VARIANTS))
def trunk(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(f"gte-{request.param}")
    reference = make_gte(folder, seed=3, **VARIANTS[request.param])
    return folder, reference, _llm(folder)


def test_hidden_states_match_transformers(trunk) -> None:
    folder, reference, llm = trunk
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["NewModel"] and config["model_type"] == "new"
    assert "encoder.layer.0.mlp.up_gate_proj.weight" in load_file(folder / "model.safetensors")
    assert llm.supported_tasks == ("embed", "token_embed")
    prompts = random_prompts(LENGTHS, seed=2)
    torch.set_num_threads(NUM_THREADS)
    for prompt, ours in zip(prompts, _token_embed(llm, prompts), strict=True):
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        assert ours.shape == expected.shape == (len(prompt), 32)
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_ntk_scaling_changes_the_output(trunk, tmp_path: Path) -> None:
    """The scaled frequencies are used: the same weights without ``rope_scaling`` differ."""
    folder, _, llm = trunk
    config = json.loads((folder / "config.json").read_text())
    if not config["rope_scaling"]:
        pytest.skip("variant without NTK scaling")
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    (plain / "config.json").write_text(json.dumps({**config, "rope_scaling": None}))
    prompts = random_prompts([60], seed=2)
    (scaled,) = _token_embed(llm, prompts)
    (unscaled,) = _token_embed(_llm(plain), prompts)
    assert (scaled - unscaled).abs().max() > 1e-3


@pytest.mark.parametrize("mixed_b", [None, 0.75])
@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_ntk_frequencies(factor: float, mixed_b: float | None) -> None:
    """Fixed and mixed NTK scaling from a NewConfig's ``rope_scaling``, against the formula
    written from the remote code in the factory."""
    scaling = {"type": "ntk", "factor": factor, "mixed_b": mixed_b}
    config = {"rope_theta": 160000.0, "rope_scaling": scaling}
    ours = RotaryEmbedding(64, rope_settings(config)).inv_freq
    expected = ntk_inv_freq(160000.0, 64, factor, mixed_b)
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)


def test_batch_invariance(trunk) -> None:
    _, _, llm = trunk
    prompts = random_prompts(LENGTHS, seed=6)
    together = _token_embed(llm, prompts)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _token_embed(llm, [prompt])
        torch.testing.assert_close(batched, alone, atol=BATCH_ATOL, rtol=0)


def test_embeddings_match_sentence_transformers(tmp_path: Path) -> None:
    """CLS pooling + Normalize, as gte-base-en-v1.5's folder; sentence-transformers loads the
    transformers-native ``GteModel`` folder (it cannot run the remote code offline), cenote the
    same folder."""
    from sentence_transformers import SentenceTransformer

    make_gte(tmp_path / "raw", seed=4, type_vocab_size=1, hub_layout=False)
    folder = save_sentence_transformer(tmp_path / "raw", tmp_path / "st", "cls")
    torch.set_num_threads(NUM_THREADS)
    theirs = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    outputs = _llm(folder).embed(TEXTS, use_tqdm=False)
    ours = torch.stack([out.outputs.data.float() for out in outputs])
    assert ours.shape == theirs.shape == (len(TEXTS), 32)
    cos = F.cosine_similarity(ours, theirs.float(), dim=-1)
    assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f}"


def test_reranker_matches_transformers(tmp_path: Path) -> None:
    """gte-multilingual-reranker-base's head (``new.pooler.dense`` + tanh on CLS, then
    ``classifier``): logits and probabilities; transformers also reads the folder's
    ``new.``-prefixed tensors back (the Hub layout)."""
    reference = make_gte(
        tmp_path, "ForSequenceClassification", seed=5, ntk_factor=2.0, num_labels=3
    )
    assert "new.pooler.dense.weight" in load_file(tmp_path / "model.safetensors")
    config = reference.config
    reloaded = transformers.GteForSequenceClassification.from_pretrained(tmp_path, config=config)
    reloaded.gte.rotary_emb.inv_freq.copy_(reference.gte.rotary_emb.inv_freq)  # NTK, as saved
    llm = _llm(tmp_path)
    assert llm.supported_tasks == ("classify",)
    prompts = random_prompts([1, 5, 40, 5], seed=8)
    outputs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    torch.set_num_threads(NUM_THREADS)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([prompt])).logits[0]
            saved = reloaded(input_ids=torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(saved, logits, atol=ATOL, rtol=0)
        ours = torch.tensor(out.outputs.probs)
        torch.testing.assert_close(ours, logits.softmax(-1), atol=PROBS_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"logn_attention_scale": True}, r"logn_attention_scale=True is not supported"),
        ({"layer_norm_type": "rms_norm"}, r"layer_norm_type='rms_norm' is not supported"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"'dynamic' is not supported"),
    ],
)
def test_unsupported_variants_are_refused_at_load(tmp_path, entry, message) -> None:
    make_gte(tmp_path / "gte", seed=1)
    folder = tmp_path / "gte"
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **entry}))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), dtype="float32")
