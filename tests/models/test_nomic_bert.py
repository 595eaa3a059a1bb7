"""NomicBERT vs transformers' native NomicBertModel and sentence-transformers, tiny random
models, fp32. The folder transformers saves uses nomic's checkpoint names; the same weights also
load with nomic's config names (``n_embd``, ``rotary_emb_base``...) and with transformers'
tensor names (separate q/k/v)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_THREADS
from factories.encoder_zoo import TEXTS, make_nomic_bert
from factories.st_folders import save_sentence_transformer
from factories.texts import random_prompts
from safetensors.torch import load_file, save_file

from cenote import LLM, PoolingParams

ATOL = 1e-4  # DESIGN.md §3: hidden states vs transformers, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs sentence-transformers, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
LENGTHS = [1, 3, 17, 17, 60, 128]


@pytest.fixture(scope="module")
def trunk(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("nomic")
    return folder, make_nomic_bert(folder, seed=3)


@pytest.fixture(scope="module")
def expected(trunk) -> list[torch.Tensor]:
    """transformers' last_hidden_state of each prompt alone."""
    _, reference = trunk
    with torch.no_grad():
        return [
            reference(input_ids=torch.tensor([p])).last_hidden_state[0]
            for p in random_prompts(LENGTHS, seed=2)
        ]


def _token_embed(folder: Path, prompts: list[list[int]], llm: LLM | None = None):
    llm = llm or LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    outputs = llm.encode(
        [{"prompt_token_ids": p} for p in prompts],
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    return [out.outputs.data for out in outputs]


def _check(folder: Path, expected: list[torch.Tensor]) -> None:
    ours = _token_embed(folder, random_prompts(LENGTHS, seed=2))
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_hidden_states_match_transformers(trunk, expected) -> None:
    names = set(load_file(trunk[0] / "model.safetensors"))
    assert "encoder.layers.0.attn.Wqkv.weight" in names  # nomic's layout, as on the Hub
    _check(trunk[0], expected)


def test_nomic_config_names(trunk, expected, tmp_path: Path) -> None:
    """config.json as nomic-embed-text ships it (remote-code names)."""
    folder = tmp_path / "hub"
    shutil.copytree(trunk[0], folder)
    config = json.loads((folder / "config.json").read_text())
    hub = {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "vocab_size": config["vocab_size"],
        "n_embd": config["hidden_size"],
        "n_head": config["num_attention_heads"],
        "n_inner": config["intermediate_size"],
        "n_layer": config["num_hidden_layers"],
        "n_positions": 8192,
        "max_trained_positions": 2048,
        "layer_norm_epsilon": config["layer_norm_eps"],
        "rotary_emb_base": config["rope_parameters"]["rope_theta"],
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_scaling_factor": None,
        "activation_function": "swiglu",
        "prenorm": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "causal": False,
        "type_vocab_size": 2,
        "pad_token_id": 0,
    }
    (folder / "config.json").write_text(json.dumps(hub))
    _check(folder, expected)


def test_transformers_tensor_names(trunk, expected, tmp_path: Path) -> None:
    """The same weights under transformers' module names (q/k/v apart, o_proj, up/gate/down)."""
    folder = tmp_path / "native"
    shutil.copytree(trunk[0], folder)
    _, reference = trunk
    save_file(
        {name: t.contiguous() for name, t in reference.state_dict().items()},
        folder / "model.safetensors",
    )
    assert "layers.0.self_attn.q_proj.weight" in load_file(folder / "model.safetensors")
    _check(folder, expected)


def test_batch_invariance(trunk) -> None:
    llm = LLM(str(trunk[0]), dtype="float32", num_threads=NUM_THREADS)
    prompts = random_prompts(LENGTHS, seed=6)
    together = _token_embed(trunk[0], prompts, llm)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _token_embed(trunk[0], [prompt], llm)
        torch.testing.assert_close(batched, alone, atol=BATCH_ATOL, rtol=0)


def test_embeddings_match_sentence_transformers(trunk, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = save_sentence_transformer(trunk[0], tmp_path / "st", "mean", max_seq_length=64)
    torch.set_num_threads(NUM_THREADS)
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    ours = torch.stack([o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)])
    assert ours.shape == expected.shape == (len(TEXTS), 32)
    cos = F.cosine_similarity(ours, expected.float(), dim=-1)
    assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f}"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"rotary_emb_fraction": 0.5}, r"rotary_emb_fraction=0.5 is not supported; supported: "),
        ({"prenorm": True}, r"prenorm=True is not supported; supported: .*prenorm=False"),
        ({"moe_every_n_layers": 2}, r"moe_every_n_layers=2 is not supported"),
        ({"hidden_act": "gelu"}, r"activation 'gelu' is not supported; supported: swiglu, silu"),
    ],
)
def test_unsupported_variants_are_refused_at_load(trunk, tmp_path, entry, message) -> None:
    folder = tmp_path / "variant"
    shutil.copytree(trunk[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **entry}))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), dtype="float32")
