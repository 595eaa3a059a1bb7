"""T5 / mT5 encoders vs transformers and sentence-transformers (sentence-t5 / GTR layout:
encoder -> mean -> Dense without bias -> Normalize), tiny random models, fp32.

The tiny config has 8 relative-position buckets up to distance 20 and ``d_kv * heads`` (64)
unlike ``d_model`` (32), so prompts past 20 tokens use the logarithmic buckets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_THREADS
from factories.encoder_zoo import TEXTS, make_t5_encoder
from factories.st_folders import save_sentence_transformer
from factories.texts import random_prompts

from cenote import LLM, PoolingParams

ATOL = 1e-4  # DESIGN.md §3: hidden states vs transformers, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs sentence-transformers, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
LENGTHS = [1, 2, 7, 7, 25, 90]
# (family, feed_forward_proj): T5 v1.0 (sentence-t5, GTR) and the gated v1.1 / mT5 MLPs
VARIANTS = [("T5", "relu"), ("T5", "gated-gelu"), ("MT5", "gated-gelu")]


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: "-".join(v))
def encoder(request, tmp_path_factory: pytest.TempPathFactory):
    family, projection = request.param
    folder = tmp_path_factory.mktemp(f"{family}-{projection}")
    reference = make_t5_encoder(folder, seed=4, family=family, feed_forward_proj=projection)
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    return folder, reference, llm


def _token_embed(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    outputs = llm.encode(
        [{"prompt_token_ids": p} for p in prompts],
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    return [out.outputs.data for out in outputs]


def test_hidden_states_match_transformers(encoder) -> None:
    _, reference, llm = encoder
    prompts = random_prompts(LENGTHS, seed=8, low=3)
    for prompt, ours in zip(prompts, _token_embed(llm, prompts), strict=True):
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        assert ours.shape == expected.shape
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_batch_invariance(encoder) -> None:
    _, _, llm = encoder
    prompts = random_prompts(LENGTHS, seed=9, low=3)
    together = _token_embed(llm, prompts)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _token_embed(llm, [prompt])
        torch.testing.assert_close(batched, alone, atol=BATCH_ATOL, rtol=0)


def test_sentence_t5_matches_sentence_transformers(encoder, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder, _, _ = encoder
    st_folder = save_sentence_transformer(
        folder, tmp_path / "st", "mean", dense=[(32, 24, False)], max_seq_length=64
    )
    modules = json.loads((st_folder / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == [
        "Transformer", "Pooling", "Dense", "Normalize",
    ]  # fmt: skip
    torch.set_num_threads(NUM_THREADS)
    st_model = SentenceTransformer(str(st_folder), device="cpu")
    expected = st_model.encode(TEXTS, convert_to_tensor=True).float()
    llm = LLM(str(st_folder), dtype="float32", num_threads=NUM_THREADS)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    ours = torch.stack([o.outputs.data for o in outputs])
    assert ours.shape == expected.shape == (len(TEXTS), 24)
    cos = F.cosine_similarity(ours, expected, dim=-1)
    assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f}"
    features = st_model.preprocess(TEXTS)  # the same tokens: text then </s>, no BOS
    for out, ids, mask in zip(
        outputs, features["input_ids"], features["attention_mask"], strict=True
    ):
        assert out.prompt_token_ids == ids[mask.bool()].tolist()


@pytest.mark.parametrize(
    ("projection", "message"),
    [
        ("gated-swish-gelu", "feed_forward_proj 'gated-swish-gelu' is not supported"),
        ("mish", r"unsupported activation 'mish'; supported: \["),
    ],
)
def test_unsupported_variants_are_refused_at_load(encoder, tmp_path, projection, message) -> None:
    folder = tmp_path / "variant"
    shutil.copytree(encoder[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "feed_forward_proj": projection}))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), dtype="float32")
