"""A GGUF file's ``tokenizer.ggml.*`` metadata read as a ``tokenizers.Tokenizer`` that splits
text as llama.cpp does: byte-level BPE here, BERT WordPiece in ``gguf_encoders.py``."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from cenote.models.formats.gguf_encoders import build_wordpiece_tokenizer
from cenote.models.formats.gguf_file import GGUFError, GGUFFile
from cenote.models.formats.gguf_metadata import (
    CONTROL_TOKEN_TYPE,
    USER_DEFINED_TOKEN_TYPE,
    read_field,
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
