"""Parity of the GGUF loader with transformers' own GGUF loading, on the real SmolLM2 file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from factories.generation import smollm2_path

from cenote.models.formats.gguf_decoders import hf_tensor_name, unpermute_rotary
from cenote.models.gguf_loader import GGUFCheckpoint, GGUFError, load_gguf

# transformers is imported inside the tests, after this: never reach the model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve über Ångström",
    "emoji 🤗🚀 and 日本語",
    "  leading spaces\n\ttabs and\n\nnewlines  ",
    "it's, they're (x+y) * z",
    "Year 2024: pi is 3.14159, 1,000,000 items",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return smollm2_path()


@pytest.fixture(scope="module")
def checkpoint(gguf_path: Path) -> GGUFCheckpoint:
    return load_gguf(gguf_path)


def test_config_is_sane(checkpoint: GGUFCheckpoint) -> None:
    config = checkpoint.config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert (checkpoint.bos_token_id, checkpoint.eos_token_id) == (1, 2)
    assert checkpoint.chat_template is not None and "<|im_start|>" in checkpoint.chat_template


def render_chat(checkpoint: GGUFCheckpoint) -> str:
    import jinja2

    template = jinja2.Environment().from_string(checkpoint.chat_template or "")
    messages = [{"role": "user", "content": "What is 2+2? Réponds en français 🙂"}]
    return template.render(messages=messages, add_generation_prompt=True)


def test_tokenizer_matches_transformers(checkpoint: GGUFCheckpoint, gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    prompt = render_chat(checkpoint)
    assert prompt.startswith("<|im_start|>system\n")
    for text in [*TEXTS, prompt]:
        ids = checkpoint.tokenizer.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert checkpoint.tokenizer.decode(ids, skip_special_tokens=False) == text
    chat_ids = checkpoint.tokenizer.encode(prompt).ids
    assert chat_ids.count(1) == 3 and chat_ids[0] == 1  # <|im_start|> kept whole, not split


def test_tokenizer_splits_digits_like_llama_cpp(checkpoint: GGUFCheckpoint) -> None:
    # tokenizer.ggml.pre == "smollm": every digit is its own pre-token, as in SmolLM2's
    # tokenizer.json (Digits(individual_digits=True)) and llama.cpp.
    tokens = checkpoint.tokenizer.encode("x 2024").tokens
    assert tokens == ["x", "Ġ", "2", "0", "2", "4"]


def test_tensors_match_transformers(checkpoint: GGUFCheckpoint, gguf_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    reference = model.state_dict()
    # Tied: transformers' state dict lists lm_head.weight as the embedding itself; we yield it
    # once, as model.embed_tokens.weight, like a Hugging Face checkpoint does.
    assert (
        reference["lm_head.weight"].data_ptr() == reference["model.embed_tokens.weight"].data_ptr()
    )
    expected_names = set(reference) - {"lm_head.weight"}
    seen: set[str] = set()
    for name, tensor in checkpoint.tensors(torch.float32):
        assert name in expected_names, name
        assert tensor.dtype == torch.float32
        assert tensor.shape == reference[name].shape, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)
        seen.add(name)
    assert seen == expected_names


def test_tensors_respect_dtype(checkpoint: GGUFCheckpoint) -> None:
    name, tensor = next(iter(checkpoint.tensors(torch.bfloat16)))
    assert name == "model.embed_tokens.weight"
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (49152, 576)


def test_unpermute_rotary_inverts_llama_cpp_permutation() -> None:
    num_heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(num_heads * head_dim, hidden)
    # convert_hf_to_gguf: rows of each head go from [2, head_dim // 2] to [head_dim // 2, 2].
    permuted = (
        weight.reshape(num_heads, 2, head_dim // 2, hidden)
        .transpose(1, 2)
        .reshape(num_heads * head_dim, hidden)
    )
    assert torch.equal(unpermute_rotary(permuted, num_heads), weight)


def test_tensor_names() -> None:
    assert hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(GGUFError, match="no Hugging Face name"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")
