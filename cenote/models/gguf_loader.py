"""Read a GGUF file as a Hugging Face-style checkpoint: config dict, tokenizer, named tensors.

A GGUF carries everything a model needs in one file, under llama.cpp's names. This module turns
it into what the rest of cenote expects from a Hugging Face checkpoint:

    checkpoint = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    checkpoint.config["architectures"]        # ["LlamaForCausalLM"]
    checkpoint.tokenizer.encode("hi").ids     # tokenizers.Tokenizer
    for name, tensor in checkpoint.tensors(torch.float32):
        ...                                   # "model.layers.0.self_attn.q_proj.weight", ...

Tensors are dequantized lazily, one at a time, so a caller can load them straight into a model
built on the `meta` device. transformers is not imported here; it is only a test reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from gguf import GGMLQuantizationType, ReaderTensor
from tokenizers import Tokenizer

from cenote.models.formats.gguf_decoders import (
    SKIPPED_TENSORS,
    build_decoder_config,
    hf_tensor_name,
    unpermute_rotary,
)
from cenote.models.formats.gguf_encoders import (
    build_encoder_config,
    encoder_st_config,
    encoder_tensors,
)
from cenote.models.formats.gguf_file import GGUFError as GGUFError  # re-exported: raised here too
from cenote.models.formats.gguf_file import GGUFFile
from cenote.models.formats.gguf_metadata import ARCHITECTURES, ENCODER_ARCHITECTURES, read_field
from cenote.models.formats.gguf_tensors import check_tensor_type, dequantize_tensor
from cenote.models.formats.gguf_tokenizer import build_tokenizer
from cenote.models.formats.st_config import SentenceTransformerConfig

if TYPE_CHECKING:
    from cenote.models.layers.quant import QuantizedWeight


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

        check_tensor_type(tensor)
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


def build_config(reader: GGUFFile) -> dict[str, Any]:
    """A Hugging Face config.json-style dict from `{arch}.*` and `tokenizer.ggml.*` metadata."""
    architecture = read_field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    if architecture in ENCODER_ARCHITECTURES:
        return build_encoder_config(reader, architecture)
    return build_decoder_config(reader, architecture)
