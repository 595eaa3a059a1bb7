"""Word-level tokenizers for the tiny models: ``specials + words + w<id>`` fillers up to
``vocab_size``, written as ``tokenizer.json`` alone or with the files transformers saves (so that
transformers and sentence-transformers load the folder too)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

VOCAB_SIZE = 128
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # MPNet's order too: <pad> = 1
NUM_SPECIAL_TOKENS = 5  # ids below this are special for BERT, RoBERTa and XLM-R
# the retrieval tests' BERT specials: [unused0] / [unused1] become ColBERT's [Q] / [D]
RETRIEVAL_BERT_SPECIALS = [*BERT_SPECIALS, "[unused0]", "[unused1]"]
T5_SPECIALS = ["<pad>", "</s>", "<unk>"]
DECODER_SPECIALS = ["<unk>", "<s>", "</s>"]  # pooling-head decoders
GENERATION_SPECIALS = ["<pad>", "<s>", "</s>"]  # generation decoders: ids 0, 1, 2
# words of the pooling / scoring tests (yes / no: classifier_from_token rerankers)
POOLING_WORDS = ["yes", "no", "query", "document", "cat", "dog", "sat", "mat", "the", "a", "+", "-"]
# words of the retrieval-model tests (punctuation: ColBERT leaves it out of MaxSim)
RETRIEVAL_WORDS = ["query", "document", "cat", "dog", "sat", "mat", "the", "a", ".", ",", "!", "?"]
BERT_INPUTS = ["input_ids", "token_type_ids", "attention_mask"]
PLAIN_INPUTS = ["input_ids", "attention_mask"]


def word_tokenizer(
    specials: Sequence[str],
    vocab_size: int = VOCAB_SIZE,
    words: Sequence[str] = (),
    pre_tokenizer: pre_tokenizers.PreTokenizer | None = None,
) -> Tokenizer:
    """WordLevel over ``specials + words + w<id>``; unknown words map to the special with "unk"
    in its name (else the first special); whitespace pre-tokenizer unless given."""
    vocab = {token: i for i, token in enumerate([*specials, *words])}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    unk = next((t for t in specials if "unk" in t.lower()), specials[0])
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.Whitespace()
    return tokenizer


def encoder_template(tokenizer: Tokenizer, specials: Sequence[str], segment_ids: bool) -> dict:
    """``CLS $A SEP`` (pairs ``CLS $A SEP $B SEP``, the second segment with type id 1 when
    ``segment_ids``): ``[CLS]`` / ``[SEP]`` for BERT specials, ``<s>`` / ``</s>`` otherwise.
    Returns the special-token names for transformers."""
    bert = specials[0] == "[PAD]"
    cls, sep, pad = ("[CLS]", "[SEP]", "[PAD]") if bert else ("<s>", "</s>", "<pad>")
    second = ":1" if segment_ids else ""
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B{second} {sep}{second}",
        special_tokens=[(cls, tokenizer.token_to_id(cls)), (sep, tokenizer.token_to_id(sep))],
    )
    return dict(cls_token=cls, sep_token=sep, pad_token=pad)


def save_tokenizer(
    tokenizer: Tokenizer, folder: Path, specials: Sequence[str], hf_names: dict | None = None
) -> None:
    """``tokenizer.json`` only, or (with ``hf_names``: unk_token, cls_token, ...) the files
    transformers' fast tokenizer saves."""
    tokenizer.add_special_tokens(list(specials))
    if hf_names is None:
        tokenizer.save(str(folder / "tokenizer.json"))
        return
    unk = tokenizer.model.unk_token
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token=unk, **hf_names
    )
    fast.save_pretrained(folder)


def write_encoder_tokenizer_json(folder: Path, specials: Sequence[str], vocab_size: int) -> None:
    """``tokenizer.json`` over ``specials + w<id>``, ``CLS $A SEP`` with segment ids for pairs."""
    tokenizer = word_tokenizer(specials, vocab_size)
    encoder_template(tokenizer, specials, segment_ids=True)
    save_tokenizer(tokenizer, folder, specials)


def write_tokenizer(folder: Path, specials: Sequence[str], pair_segments: bool = True) -> None:
    """The pooling tests' tokenizer (``POOLING_WORDS``), loadable by transformers: encoders get
    ``CLS $A SEP [$B SEP]`` (BERT hands the model segment ids); decoders
    (``pair_segments=False``) nothing."""
    tokenizer = word_tokenizer(specials, words=POOLING_WORDS)
    names: dict = {}
    if pair_segments:
        bert = specials[0] == "[PAD]"
        names = encoder_template(tokenizer, specials, segment_ids=bert)
        if bert:
            names["model_input_names"] = BERT_INPUTS
    save_tokenizer(tokenizer, folder, specials, names)


def write_retrieval_tokenizer(
    folder: Path, specials: Sequence[str], token_types: bool = False
) -> None:
    """The retrieval tests' tokenizer (``RETRIEVAL_WORDS``, punctuation split off), loadable by
    transformers: BERT specials ``[CLS] $A [SEP] ($B [SEP])``; T5 ``$A </s>``."""
    split = [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    tokenizer = word_tokenizer(
        specials, words=RETRIEVAL_WORDS, pre_tokenizer=pre_tokenizers.Sequence(split)
    )
    if specials[0] == "[PAD]":
        names = encoder_template(tokenizer, specials, segment_ids=token_types)
        names.update(
            mask_token="[MASK]", model_input_names=BERT_INPUTS if token_types else PLAIN_INPUTS
        )
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A </s>",
            pair="$A </s> $B </s>",
            special_tokens=[("</s>", tokenizer.token_to_id("</s>"))],
        )
        names = dict(eos_token="</s>", pad_token="<pad>", model_input_names=PLAIN_INPUTS)
    save_tokenizer(tokenizer, folder, specials, names)


def write_generation_tokenizer(folder: Path, vocab_size: int) -> None:
    """``tokenizer.json`` over ``<pad> <s> </s> w3 ... w<vocab_size - 1>``: whitespace-split
    words that decode back joined by single spaces."""
    tokenizer = word_tokenizer(
        GENERATION_SPECIALS, vocab_size, pre_tokenizer=pre_tokenizers.WhitespaceSplit()
    )
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with " "
    save_tokenizer(tokenizer, folder, GENERATION_SPECIALS)


def write_byte_level_tokenizer(folder: Path, merges: Sequence[tuple[str, str]] = ()) -> int:
    """``tokenizer.json`` of a GPT-2 style byte-level BPE: ``<pad> <s> </s>``, the 256 byte
    symbols, then one token per merge (pairs of byte symbols or earlier merges): any text can
    be written, as structured outputs need. Returns the tokenizer's vocabulary size."""
    vocab = {special: i for i, special in enumerate(GENERATION_SPECIALS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, list(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    save_tokenizer(tokenizer, folder, GENERATION_SPECIALS)
    return len(vocab)
