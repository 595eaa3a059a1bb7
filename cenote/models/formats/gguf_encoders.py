"""BERT-family GGUF files (llama.cpp's ``bert`` and ``nomic-bert``) read as Hugging Face
checkpoints: config, WordPiece tokenizer, tensor names and the embedding pooling.

llama.cpp's converter writes a BERT WordPiece vocabulary in "phantom space" form: a word-start
token gets a leading ``▁``, a continuation token loses its ``##``, control tokens ([CLS], [SEP],
...) stay as they are. Reading it back gives the original vocabulary, and the tokenizer built
here tokenizes as the original BERT tokenizer does (lowercase, accents stripped, punctuation and
CJK split; llama.cpp's own WordPiece always lowercases, and a GGUF records no casing flag).

Tensors keep their Hugging Face names: ``blk.3.attn_q.weight`` ->
``encoder.layer.3.attention.self.query.weight`` (BertModel) and ``blk.3.ffn_gate.weight`` ->
``encoder.layers.3.mlp.fc12.weight`` (NomicBertModel, nomic's layout). The embedding pooling
comes from ``{arch}.pooling_type``; embeddings are L2-normalized, as llama.cpp returns them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from gguf import PoolingType, ReaderTensor
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from cenote.models.formats.gguf_file import GGUFError, GGUFFile
from cenote.models.formats.gguf_metadata import (
    CONTROL_TOKEN_TYPE,
    arch_field,
    base_config,
    float32_value,
    read_field,
)
from cenote.models.formats.gguf_tensors import dequantize_tensor
from cenote.models.formats.st_config import PoolingMethodName, SentenceTransformerConfig

PHANTOM_SPACE = "\u2581"  # llama.cpp's word-start marker in WordPiece vocabularies

# llama.cpp tensor name (without ".weight"/".bias") -> HF parameter name, per architecture
_GLOBAL_NAMES: dict[str, dict[str, str]] = {
    "bert": {
        "token_embd": "embeddings.word_embeddings",
        "position_embd": "embeddings.position_embeddings",
        "token_types": "embeddings.token_type_embeddings",
        "token_embd_norm": "embeddings.LayerNorm",
    },
    "nomic-bert": {
        "token_embd": "embeddings.word_embeddings",
        "token_types": "embeddings.token_type_embeddings",
        "token_embd_norm": "emb_ln",
    },
}
# per layer: "blk.N.<key>" -> "<prefix>N.<value>"
_LAYER_PREFIXES = {"bert": "encoder.layer.", "nomic-bert": "encoder.layers."}
_LAYER_NAMES: dict[str, dict[str, str]] = {
    "bert": {
        "attn_q": "attention.self.query",
        "attn_k": "attention.self.key",
        "attn_v": "attention.self.value",
        "attn_output": "attention.output.dense",
        "attn_output_norm": "attention.output.LayerNorm",
        "ffn_up": "intermediate.dense",
        "ffn_down": "output.dense",
        "layer_output_norm": "output.LayerNorm",
    },
    "nomic-bert": {
        "attn_qkv": "attn.Wqkv",
        "attn_output": "attn.out_proj",
        "attn_output_norm": "norm1",
        "ffn_up": "mlp.fc11",
        "ffn_gate": "mlp.fc12",
        "ffn_down": "mlp.fc2",
        "layer_output_norm": "norm2",
    },
}
# a fused QKV in a ``bert`` file (llama.cpp accepts one) goes back to BERT's three projections
_BERT_QKV = ("attention.self.query", "attention.self.key", "attention.self.value")

# {arch}.pooling_type -> sentence-transformers pooling (NONE: the engine's default, CLS)
_POOLING: dict[int, PoolingMethodName | None] = {
    PoolingType.NONE: None,
    PoolingType.MEAN: "mean",
    PoolingType.CLS: "cls",
    PoolingType.LAST: "last",
}


def build_encoder_config(reader: GGUFFile, architecture: str) -> dict[str, Any]:
    """A config.json-style dict for BertModel / NomicBertModel from ``{arch}.*`` metadata."""
    arch = partial(arch_field, reader, architecture)
    if arch("attention.causal", False):
        raise GGUFError(
            f"GGUF {architecture} file has {architecture}.attention.causal = true; cenote runs "
            "BERT-family encoders with bidirectional attention only"
        )
    config = base_config(reader, architecture)
    config["layer_norm_eps"] = float32_value(arch("attention.layer_norm_epsilon", 1e-12))
    config["type_vocab_size"] = _type_vocab_size(reader)
    if architecture == "bert":
        config["hidden_act"] = "gelu"
    else:  # llama.cpp's default rotary base when a file states none
        theta = float32_value(arch("rope.freq_base", 10000.0))
        config["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    return config


def _type_vocab_size(reader: GGUFFile) -> int:
    """``tokenizer.ggml.token_type_count``, else the rows of the ``token_types`` tensor."""
    count = read_field(reader, "tokenizer.ggml.token_type_count")
    if count is not None:
        return int(count)
    for tensor in reader.tensors:
        if tensor.name == "token_types.weight":
            return int(tensor.shape[-1])  # GGUF lists dims reversed: [hidden, types]
    return 2


def encoder_st_config(reader: GGUFFile, architecture: str) -> SentenceTransformerConfig | None:
    """The embedding pooling a file declares (``{arch}.pooling_type``), normalized as llama.cpp
    returns embeddings; None when the file declares none."""
    kind = read_field(reader, f"{architecture}.pooling_type")
    if kind is None:
        return None
    if kind not in _POOLING:
        raise GGUFError(
            f"GGUF {architecture}.pooling_type {kind} ({_pooling_name(kind)}) is not supported; "
            f"supported: {', '.join(PoolingType(k).name for k in _POOLING)}"
        )
    return SentenceTransformerConfig(pooling=_POOLING[kind], normalize=True)


def _pooling_name(kind: int) -> str:
    try:
        return PoolingType(kind).name
    except ValueError:
        return "unknown"


def build_wordpiece_tokenizer(reader: GGUFFile) -> Tokenizer:
    """BERT's WordPiece tokenizer from a ``tokenizer.ggml.model = "bert"`` vocabulary."""
    tokens: list[str] = read_field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = read_field(reader, "tokenizer.ggml.token_type") or []
    kinds = token_types + [0] * (len(tokens) - len(token_types))

    # 1) The original vocabulary: "▁word" -> "word", "piece" -> "##piece", controls unchanged.
    def original(token: str, kind: int) -> str:
        if kind == CONTROL_TOKEN_TYPE:
            return token
        if token.startswith(PHANTOM_SPACE):
            return token[len(PHANTOM_SPACE) :]
        return "##" + token

    originals = [original(token, kind) for token, kind in zip(tokens, kinds, strict=True)]
    vocab = {token: i for i, token in enumerate(originals)}
    if len(vocab) != len(tokens):
        raise GGUFError(
            "GGUF WordPiece vocabulary has duplicate tokens after phantom-space decoding"
        )
    unk_id = read_field(reader, "tokenizer.ggml.unknown_token_id")
    unk = originals[unk_id] if unk_id is not None else "[UNK]"
    tokenizer = Tokenizer(WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))

    # 2) BERT's text handling: clean, split CJK, lowercase and strip accents; words and
    #    punctuation apart.
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)

    # 3) Control tokens stay whole and are special.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, kinds, strict=True)
            if kind == CONTROL_TOKEN_TYPE
        ]
    )

    # 4) [CLS] A [SEP] (B [SEP], segment 1), as llama.cpp and the BERT tokenizer add them.
    cls_id = _first_id(reader, "cls_token_id", "bos_token_id")
    sep_id = _first_id(reader, "seperator_token_id", "eos_token_id")
    if cls_id is not None and sep_id is not None:
        cls, sep = originals[cls_id], originals[sep_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}",
            pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, cls_id), (sep, sep_id)],
        )
    return tokenizer


def _first_id(reader: GGUFFile, *names: str) -> int | None:
    for name in names:
        value = read_field(reader, f"tokenizer.ggml.{name}")
        if value is not None:
            return int(value)
    return None


def encoder_tensors(architecture: str, tensor: ReaderTensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, float32 tensor)`` for one GGUF tensor of a BERT-family file (a fused QKV of a
    ``bert`` file yields its three projections)."""
    match = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", tensor.name)
    if match is None:
        raise GGUFError(f"unexpected GGUF tensor name {tensor.name!r}")
    layer, base, kind = match.groups()
    if layer is None and base in _GLOBAL_NAMES[architecture]:
        yield f"{_GLOBAL_NAMES[architecture][base]}.{kind}", dequantize_tensor(tensor)
        return
    prefix = f"{_LAYER_PREFIXES[architecture]}{layer}."
    if layer is not None and architecture == "bert" and base == "attn_qkv":
        weight = dequantize_tensor(tensor)  # [3 * hidden, hidden] or [3 * hidden]
        for name, part in zip(_BERT_QKV, weight.chunk(3, dim=0), strict=True):
            yield f"{prefix}{name}.{kind}", part
        return
    if layer is not None and base in _LAYER_NAMES[architecture]:
        yield f"{prefix}{_LAYER_NAMES[architecture][base]}.{kind}", dequantize_tensor(tensor)
        return
    raise GGUFError(
        f"GGUF tensor {tensor.name!r} has no place in a {architecture} encoder; known: "
        f"{sorted(_GLOBAL_NAMES[architecture])} and blk.N.{sorted(_LAYER_NAMES[architecture])}"
    )
