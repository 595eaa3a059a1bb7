"""BERT-family GGUF embedders (llama.cpp's ``bert`` and ``nomic-bert``) against the originals.

The GGUF files are written here from Hugging Face folders as llama.cpp's converter writes them
(tests/gguf_factories.py): all-MiniLM-L6-v2's real weights at F32 and F16, and a tiny random
NomicBERT. cenote loads config, WordPiece tokenizer and pooling from the file's metadata alone and
must embed as sentence-transformers does on the original folder.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_THREADS
from factories.encoder_zoo import TEXTS, make_nomic_bert
from factories.gguf import write_and_close, write_encoder_gguf
from factories.st_folders import save_sentence_transformer
from factories.texts import random_prompts
from tokenizers import Tokenizer

from cenote import LLM, PoolingParams
from cenote.models.gguf_loader import GGUFError, load_gguf

ATOL = 1e-4  # DESIGN.md §3: hidden states vs transformers, fp32
MIN_COSINE = 0.9999  # issue 11: GGUF embeddings vs sentence-transformers at F32 and F16
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32

# what the BERT tokenizer must agree on: case, accents, CJK, punctuation, unknown characters,
# control characters, a word past 100 characters, special tokens written in the text
MINILM_TEXTS = [
    "Hello, World!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve über ÅNGSTRÖM résumé",
    "日本語のテキスト and 中文 mixed in",
    "emoji 🤗🚀 become [UNK]",
    "don't stop-believing (x+y)*z = 3.14159; 1,000,000 items",
    "  leading spaces\n\ttabs and\n\nnewlines  ",
    "unaffable antidisestablishmentarianism tokenization",
    "[CLS] written [SEP] in the [MASK] text",
    "a" * 120 + " long word",
]
F16_FILE = gguf.LlamaFileType.MOSTLY_F16
F32_FILE = gguf.LlamaFileType.ALL_F32


@pytest.fixture(scope="module")
def minilm_ggufs(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("minilm_gguf")
    return {
        name: write_encoder_gguf(minilm_path, folder / f"{name}.gguf", gguf.MODEL_ARCH.BERT, kind)
        for name, kind in (("f32", F32_FILE), ("f16", F16_FILE))
    }


def test_minilm_metadata_reads_as_the_folder(minilm_ggufs, minilm_path: Path) -> None:
    checkpoint = load_gguf(minilm_ggufs["f32"])
    config = checkpoint.config
    assert config["architectures"] == ["BertModel"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        384,
        6,
        30522,
    )
    assert config["layer_norm_eps"] == 1e-12 and config["type_vocab_size"] == 2
    assert checkpoint.st_config is not None
    assert (checkpoint.st_config.pooling, checkpoint.st_config.normalize) == ("mean", True)


def test_minilm_tokenizer_matches_the_folder_tokenizer(minilm_ggufs, minilm_path: Path) -> None:
    ours = load_gguf(minilm_ggufs["f32"]).tokenizer
    reference = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    reference.no_padding()
    reference.no_truncation()
    for text in MINILM_TEXTS:
        assert ours.encode(text).ids == reference.encode(text).ids, text
    pair_ours = ours.encode("a query", "a document")
    pair_reference = reference.encode("a query", "a document")
    assert pair_ours.ids == pair_reference.ids
    assert pair_ours.type_ids == pair_reference.type_ids
    ids = reference.encode(MINILM_TEXTS[1]).ids
    assert ours.decode(ids) == reference.decode(ids)


def test_minilm_tensors_are_the_folder_tensors(minilm_ggufs, minilm_path: Path) -> None:
    from safetensors.torch import load_file

    expected = load_file(minilm_path / "model.safetensors")
    skipped = {n for n in expected if n.endswith("position_ids") or n.startswith("pooler.")}
    seen = set()
    for name, tensor in load_gguf(minilm_ggufs["f32"]).tensors(torch.float32):
        assert torch.equal(tensor, expected[name]), name
        seen.add(name)
    assert seen == set(expected) - skipped


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_minilm_gguf_embeds_like_sentence_transformers(minilm_ggufs, st_model, kind) -> None:
    llm = LLM(str(minilm_ggufs[kind]), dtype="float32", num_threads=NUM_THREADS)
    ours = torch.stack([out.outputs.data for out in llm.embed(MINILM_TEXTS, use_tqdm=False)])
    theirs = st_model.encode(MINILM_TEXTS, convert_to_tensor=True).float()
    assert ours.shape == theirs.shape == (len(MINILM_TEXTS), 384)
    cosine = F.cosine_similarity(ours, theirs, dim=-1)
    assert float(cosine.min()) >= MIN_COSINE, cosine
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(MINILM_TEXTS)))
    alone = [llm.embed([text], use_tqdm=False)[0].outputs.data for text in MINILM_TEXTS[:3]]
    torch.testing.assert_close(torch.stack(alone), ours[:3], atol=BATCH_ATOL, rtol=0)


# ---- NomicBERT ---------------------------------------------------------------------------------

NOMIC_LENGTHS = [1, 3, 17, 17, 60, 128]


@pytest.fixture(scope="module")
def nomic(tmp_path_factory: pytest.TempPathFactory):
    """(GGUF file, sentence-transformers folder, transformers model) of one tiny NomicBERT."""
    root = tmp_path_factory.mktemp("nomic_gguf")
    reference = make_nomic_bert(root / "trunk", seed=5)
    st_folder = save_sentence_transformer(root / "trunk", root / "st", "mean", max_seq_length=64)
    path = write_encoder_gguf(root / "trunk", root / "nomic.gguf", gguf.MODEL_ARCH.NOMIC_BERT)
    return path, st_folder, reference


def test_nomic_gguf_hidden_states_match_transformers(nomic) -> None:
    path, _, reference = nomic
    assert load_gguf(path).config["architectures"] == ["NomicBertModel"]
    prompts = random_prompts(NOMIC_LENGTHS, seed=2)
    llm = LLM(str(path), dtype="float32", num_threads=NUM_THREADS)
    outputs = llm.encode(
        [{"prompt_token_ids": p} for p in prompts],
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    for out, prompt in zip(outputs, prompts, strict=True):
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)


def test_nomic_gguf_embeds_like_sentence_transformers(nomic) -> None:
    from sentence_transformers import SentenceTransformer

    path, st_folder, _ = nomic
    llm = LLM(str(path), dtype="float32", num_threads=NUM_THREADS)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    st = SentenceTransformer(str(st_folder), device="cpu")
    reference_ids = [st.tokenizer(text)["input_ids"] for text in TEXTS]
    assert [out.prompt_token_ids for out in outputs] == reference_ids
    ours = torch.stack([out.outputs.data for out in outputs])
    theirs = st.encode(TEXTS, convert_to_tensor=True).float()
    assert float(F.cosine_similarity(ours, theirs, dim=-1).min()) >= MIN_COSINE


# ---- files cenote refuses, by name -------------------------------------------------------------


def _rewrite(source: Path, target: Path, **changes) -> Path:
    """A copy of GGUF ``source`` with metadata values replaced and extra F32 tensors added
    (``changes``: key -> value, or "tensors" -> {name: array})."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    extra = changes.pop("tensors", {})
    writer = gguf.GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = changes.pop(key, field.contents())
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    assert not changes, changes
    for tensor in reader.tensors:
        shape = [int(d) for d in reversed(tensor.shape)]
        writer.add_tensor(tensor.name, tensor.data, raw_shape=shape, raw_dtype=tensor.tensor_type)
    for name, array in extra.items():
        writer.add_tensor(name, array)
    write_and_close(writer)
    return target


def test_unexpected_tensor_is_named(nomic, tmp_path: Path) -> None:
    extra = {"blk.0.attn_q_norm.weight": torch.ones(32).numpy()}
    path = _rewrite(nomic[0], tmp_path / "extra.gguf", tensors=extra)
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q_norm\.weight' has no place"):
        LLM(str(path), dtype="float32", num_threads=NUM_THREADS)


def test_rank_pooling_and_causal_files_are_refused(nomic, tmp_path: Path) -> None:
    rank = _rewrite(nomic[0], tmp_path / "rank.gguf", **{"nomic-bert.pooling_type": 4})
    with pytest.raises(GGUFError, match="pooling_type 4 .RANK. is not supported; supported: NONE"):
        load_gguf(rank)
    causal = _rewrite(nomic[0], tmp_path / "causal.gguf", **{"nomic-bert.attention.causal": True})
    with pytest.raises(GGUFError, match="attention.causal = true"):
        load_gguf(causal)
