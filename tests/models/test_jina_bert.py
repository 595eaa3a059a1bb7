"""JinaBERT (jina-embeddings-v2, jina-reranker-v1) vs a reference reconstructed from the remote
code's math, tiny random models, fp32.

transformers has no JinaBERT and its remote code cannot be fetched offline; the reference is
``factories.jina_bert.JinaBertReference`` (written apart from cenote's model, in the remote
code's shape: padded batches with a key mask, a dense ALiBi tensor over the padded length,
separate q/k/v). Sentence embeddings are its mean pooling over a padded batch the folder's own
tokenizer built (transformers' ``AutoTokenizer``), as sentence-transformers would pool them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import NUM_THREADS
from factories.encoder_zoo import TEXTS
from factories.jina_bert import cosine, make_jina_bert, mean_pool, reference_slopes
from factories.texts import random_prompts

from cenote import LLM, PoolingParams
from cenote.models.jina_bert import alibi_slopes

ATOL = 1e-4  # DESIGN.md §3: hidden states / logits vs the reference, fp32
PROBS_ATOL = 1e-5  # DESIGN.md §3: classifier probabilities, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs the reference pooling, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
LENGTHS = [1, 3, 17, 17, 60, 300]
# jina-embeddings-v2-base-en (12 heads: not a power of two) / small-en (8 heads), geglu;
# reglu as the remote code allows it
VARIANTS = {
    "six-heads": dict(num_attention_heads=6, hidden_size=48),
    "four-heads": dict(),
    "reglu": dict(feed_forward_type="reglu"),
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
    folder = tmp_path_factory.mktemp(f"jina-{request.param}")
    reference = make_jina_bert(folder, seed=3, **VARIANTS[request.param])
    return folder, reference, _llm(folder)


@pytest.mark.parametrize("heads", [1, 2, 4, 6, 8, 12, 16, 24])
def test_alibi_slopes_match_the_reference(heads: int) -> None:
    assert alibi_slopes(heads) == pytest.approx(reference_slopes(heads), rel=1e-12)


def test_hidden_states_match_reference(trunk) -> None:
    """Each prompt alone in the reference; the longest (300) past the kernel's key blocks."""
    _, reference, llm = trunk
    assert llm.supported_tasks == ("embed", "token_embed")
    prompts = random_prompts(LENGTHS, seed=2)
    torch.set_num_threads(NUM_THREADS)
    for prompt, ours in zip(prompts, _token_embed(llm, prompts), strict=True):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt]))[0]
        assert ours.shape == expected.shape
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_batch_invariance(trunk) -> None:
    _, _, llm = trunk
    prompts = random_prompts(LENGTHS, seed=6)
    together = _token_embed(llm, prompts)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _token_embed(llm, [prompt])
        torch.testing.assert_close(batched, alone, atol=BATCH_ATOL, rtol=0)


def test_embeddings_match_reference_mean_pooling(trunk) -> None:
    """Texts through the folder's tokenizer, padded into one batch for the reference (its key
    mask hides the padding), mean-pooled; cenote's ``embed`` reads the folder's Pooling."""
    from transformers import AutoTokenizer

    folder, reference, llm = trunk
    batch = AutoTokenizer.from_pretrained(str(folder))(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = reference(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    expected = mean_pool(hidden, batch["attention_mask"])
    outputs = llm.embed(TEXTS, use_tqdm=False)
    ours = torch.stack([out.outputs.data.float() for out in outputs])
    assert ours.shape == expected.shape
    cos = cosine(ours, expected)
    assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f}"
    for out, ids, mask in zip(outputs, batch["input_ids"], batch["attention_mask"], strict=True):
        assert out.prompt_token_ids == ids[mask.bool()].tolist()


def test_model_architecture_and_prefixed_checkpoint(tmp_path: Path) -> None:
    """``JinaBertModel`` in config.json and the trunk's tensors under ``bert.`` (as a masked-LM
    save writes them) load the same."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "jina"
    reference = make_jina_bert(folder, seed=5, architecture="JinaBertModel")
    tensors = load_file(folder / "model.safetensors")
    save_file({f"bert.{name}": t for name, t in tensors.items()}, folder / "model.safetensors")
    prompt = random_prompts([40], seed=1)
    (ours,) = _token_embed(_llm(folder), prompt)
    with torch.no_grad():
        expected = reference(torch.tensor(prompt))[0]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_reranker_matches_reference(tmp_path: Path) -> None:
    """jina-reranker-v1's head: pooler dense + tanh on CLS, then the classifier; logits as
    probabilities."""
    reference = make_jina_bert(tmp_path, seed=7, num_labels=3)
    llm = _llm(tmp_path)
    assert llm.supported_tasks == ("classify",)
    prompts = random_prompts([1, 5, 70, 5], seed=8)
    outputs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = reference.classify(torch.tensor([prompt]))[0]
        ours = torch.tensor(out.outputs.probs)
        torch.testing.assert_close(ours, logits.softmax(-1), atol=PROBS_ATOL, rtol=0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"position_embedding_type": "absolute"}, r"'absolute' is not supported; supported: alibi"),
        ({"feed_forward_type": "original"}, r"'original' is not supported; supported: geglu"),
    ],
)
def test_unsupported_variants_are_refused_at_load(trunk, tmp_path, entry, message) -> None:
    folder = tmp_path / "variant"
    shutil.copytree(trunk[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **entry}))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), dtype="float32")
