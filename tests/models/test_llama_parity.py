"""Parity of the Llama-family decoders with transformers, with and without a paged KV cache."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

from cenote.forward_context import AttentionMetadata, forward_context
from cenote.models.config_reader import read_model_config
from cenote.models.layers.attention import kv_cache_shape
from cenote.models.loader import load_model

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 8
_SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
# name -> (config class, causal-LM class name, config overrides)
VARIANTS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "Llama", dict(num_hidden_layers=3)),
    "llama3_tied": (
        "LlamaConfig",
        "Llama",
        dict(rope_scaling=_LLAMA3_ROPE, rope_theta=10000.0, tie_word_embeddings=True),
    ),
    "qwen2": ("Qwen2Config", "Qwen2", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3", dict(head_dim=32, tie_word_embeddings=False)),
}


def _hf_model(variant: str, head: str, **extra) -> torch.nn.Module:
    """A seeded random transformers model with every parameter (norms, biases) non-trivial."""
    config_class, prefix, overrides = VARIANTS[variant]
    config = getattr(transformers, config_class)(**{**_SMALL, **overrides, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}{head}")(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _save_and_load(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    model.save_pretrained(folder)
    return load_model(read_model_config(folder, dtype="float32"))


@dataclass
class Pair:
    ours: torch.nn.Module
    theirs: torch.nn.Module


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def causal_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    theirs = _hf_model(request.param, "ForCausalLM")
    ours = _save_and_load(theirs, tmp_path_factory.mktemp(request.param))
    return Pair(ours, theirs)


def _prompts(lengths: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=generator) for n in lengths]


def _reference_logits(theirs: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return theirs(prompt.unsqueeze(0)).logits[0].float()  # [len, vocab]


def test_flat_batch_without_cache_matches_transformers(causal_pair: Pair) -> None:
    prompts = _prompts([5, 9, 9, 3])
    lens = [len(p) for p in prompts]
    loc = [0]
    for n in lens:
        loc.append(loc[-1] + n)
    input_ids = torch.cat(prompts)  # [num_tokens]
    positions = torch.cat([torch.arange(n) for n in lens])
    metadata = AttentionMetadata(query_start_loc=loc, seq_lens=lens, causal=True)
    with torch.no_grad(), forward_context(metadata):
        logits = causal_pair.ours.compute_logits(causal_pair.ours(input_ids, positions))
    assert logits.dtype == torch.float32
    for i, prompt in enumerate(prompts):
        expected = _reference_logits(causal_pair.theirs, prompt)
        torch.testing.assert_close(logits[loc[i] : loc[i + 1]], expected, atol=ATOL, rtol=0)


# (request index, first token, end token) of each request scheduled in a step
STEPS: list[list[tuple[int, int, int]]] = [
    [(0, 0, 6), (1, 0, 3)],  # two prefills
    [(0, 6, 9), (1, 3, 4)],  # a chunk after cached context + a lone decode
    [(0, 9, 10), (1, 4, 5)],  # batched decode, block tables of different lengths
    [(0, 10, 11), (1, 5, 6)],
    [(1, 6, 7)],  # a lone decode
]
BLOCK_TABLES = [[0, 5, 2], [3, 1]]  # interleaved, out of order


def _step_metadata(
    step: list[tuple[int, int, int]], kv_caches: list[torch.Tensor]
) -> AttentionMetadata:
    loc, slots = [0], []
    for request, start, end in step:
        loc.append(loc[-1] + end - start)
        table = BLOCK_TABLES[request]
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
    return AttentionMetadata(
        query_start_loc=loc,
        seq_lens=[end for _, _, end in step],
        causal=True,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=[BLOCK_TABLES[request] for request, _, _ in step],
        block_size=BLOCK_SIZE,
        kv_caches=kv_caches,
    )


def test_paged_prefill_chunks_and_decode_match_transformers(causal_pair: Pair) -> None:
    ours = causal_pair.ours
    prompts = _prompts([11, 7])
    expected = [_reference_logits(causal_pair.theirs, p) for p in prompts]
    kv_caches = [
        torch.zeros(kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, ours.num_kv_heads, ours.head_dim))
        for _ in range(ours.num_layers)
    ]
    for step in STEPS:
        input_ids = torch.cat([prompts[r][s:e] for r, s, e in step])
        positions = torch.cat([torch.arange(s, e) for _, s, e in step])
        with torch.no_grad(), forward_context(_step_metadata(step, kv_caches)):
            logits = ours.compute_logits(ours(input_ids, positions))
        offset = 0
        for request, start, end in step:
            got = logits[offset : offset + end - start]
            torch.testing.assert_close(got, expected[request][start:end], atol=ATOL, rtol=0)
            offset += end - start


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_sequence_classification_matches_transformers(variant: str, tmp_path: Path) -> None:
    theirs = _hf_model(variant, "ForSequenceClassification", num_labels=3)
    ours = _save_and_load(theirs, tmp_path)
    prompt = _prompts([7])[0]
    metadata = AttentionMetadata(query_start_loc=[0, 7], seq_lens=[7], causal=True)
    with torch.no_grad(), forward_context(metadata):
        scores = ours.compute_scores(ours(prompt, torch.arange(7))[-1:])
    with torch.no_grad():
        expected = theirs(prompt.unsqueeze(0)).logits.float()  # [1, num_labels]
    assert scores.shape == (1, 3)
    torch.testing.assert_close(scores, expected, atol=ATOL, rtol=0)


def test_registry_and_cache_geometry(causal_pair: Pair) -> None:
    config = causal_pair.theirs.config
    assert causal_pair.ours.is_causal
    assert causal_pair.ours.num_layers == config.num_hidden_layers
    assert causal_pair.ours.num_kv_heads == config.num_key_value_heads
    assert causal_pair.ours.head_dim == getattr(config, "head_dim", 16)


@pytest.mark.parametrize(
    "rope_scaling",
    [{"type": "linear", "factor": 2.0}, {"rope_type": "llama3", **_LLAMA3_ROPE}],
    ids=["linear", "llama3"],
)
def test_rope_from_legacy_config_keys_matches_transformers(rope_scaling: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from cenote.models.layers.rotary import RotaryEmbedding

    legacy = {**_SMALL, "rope_theta": 500.0, "rope_scaling": rope_scaling}  # pre-v5 config.json
    hf_config = transformers.LlamaConfig(**legacy)
    expected, _ = ROPE_INIT_FUNCTIONS[hf_config.rope_parameters["rope_type"]](hf_config, "cpu")
    torch.testing.assert_close(RotaryEmbedding(16, legacy).inv_freq, expected, atol=0, rtol=1e-6)
