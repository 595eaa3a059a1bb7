"""BERT-family GGUF files written the way llama.cpp's converter writes them, from a saved
Hugging Face folder: gguf-py's own tensor-name map and special-vocabulary reader, a phantom-space
WordPiece vocabulary (``tokenizer.ggml.model = "bert"``), ``{arch}.pooling_type`` and
``{arch}.attention.causal = false``; at F16, 2-D weights in F16 and the rest (norms, biases,
position and token-type embeddings) in F32, as the converter keeps them."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

PHANTOM_SPACE = "\u2581"
# kept in F32 at F16 by the converter (besides every 1-D tensor)
_F32_TENSORS = ("position_embd.", "token_types.")


def _vocabulary(folder: Path) -> tuple[list[str], list[int]]:
    """tokenizer.json's tokens in id order and their llama.cpp types, in phantom-space form:
    special tokens are CONTROL and unchanged, ``##piece`` -> ``piece``, ``word`` -> ``▁word``."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    specials = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tokenizer["added_tokens"]})
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    assert len(tokens) == max(vocab.values()) + 1, "vocabulary ids have gaps"
    types, phantom = [], []
    for token in tokens:
        if token in specials:
            types.append(gguf.TokenType.CONTROL)
            phantom.append(token)
        else:
            types.append(gguf.TokenType.NORMAL)
            phantom.append(token[2:] if token.startswith("##") else PHANTOM_SPACE + token)
    return phantom, types


def write_encoder_gguf(
    folder: Path,
    out: Path,
    arch: gguf.MODEL_ARCH,
    file_type: gguf.LlamaFileType = gguf.LlamaFileType.ALL_F32,
    pooling: gguf.PoolingType = gguf.PoolingType.MEAN,
) -> Path:
    """``folder`` (a BertModel or NomicBertModel save with a WordPiece-compatible tokenizer.json)
    as a llama.cpp ``bert`` / ``nomic-bert`` GGUF file at ``out``."""
    config = json.loads((folder / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    # 1) hyperparameters
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(num_layers)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    if arch == gguf.MODEL_ARCH.NOMIC_BERT:
        writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(pooling)
    writer.add_file_type(file_type)
    # 2) vocabulary and special tokens
    tokens, types = _vocabulary(folder)
    writer.add_token_type_count(config.get("type_vocab_size", 1))
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer)
    # 3) tensors under llama.cpp's names
    names = gguf.get_tensor_name_map(arch, num_layers)
    for hf_name, tensor in load_file(folder / "model.safetensors").items():
        if hf_name.endswith("position_ids") or hf_name.startswith("pooler."):
            continue  # the converter drops them: embeddings only
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = tensor.float().numpy()
        f16 = file_type == gguf.LlamaFileType.MOSTLY_F16 and data.ndim == 2
        if f16 and not name.startswith(_F32_TENSORS):
            data = data.astype(np.float16)
        writer.add_tensor(name, data)
    write_and_close(writer)
    return out


def write_and_close(writer: gguf.GGUFWriter) -> None:
    """Header, key-values and tensors to the writer's file, in the order GGUF lays them out."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
