from __future__ import annotations

import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cenote.sampling.detokenizer import IncrementalDetokenizer, TokenTexts

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve façade, Ærøskøbing.",
    "日本語のテキストと中文文本。",
    "Emoji time 🦊🐶🚀 and flags 🇫🇷 with spaces   between.",
    "The end. The end? The end!",
]
TEXTS = [
    "Hello world, the café is naïve.",
    "  leading spaces and 日本語 mixed with 🦊🚀 emoji",
    "Ærøskøbing 中文 🇫🇷 brûlée!",
    "unseen words zebra quokka 🐙 漢字",
]
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    deltas = [detokenizer.decode_next([token_id]) for token_id in token_ids]
    deltas.append(detokenizer.finish())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    token_ids = tokenizer.encode(text).ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = stream(detokenizer, token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids) == text
    assert detokenizer.output_text == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_multibyte_character_is_held_back(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("🐙").ids  # unseen emoji: split into byte tokens
    assert len(token_ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.decode_next([t]) for t in token_ids]
    assert deltas == [""] * (len(token_ids) - 1) + ["🐙"]


def test_output_after_prompt(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The quick brown fox").ids
    output = tokenizer.encode(" jumps over 日本 🚀 dog").ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert "".join(stream(detokenizer, output)) == " jumps over 日本 🚀 dog"


def test_chunks_of_several_tokens(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(TEXTS[1]).ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.decode_next(token_ids[i : i + 3]) for i in range(0, len(token_ids), 3)]
    assert "".join(deltas) + detokenizer.finish() == TEXTS[1]


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer: Tokenizer, skip: bool) -> None:
    eos = tokenizer.token_to_id(EOS)
    token_ids = tokenizer.encode("Hello world").ids + [eos]
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    text = "".join(stream(detokenizer, token_ids))
    assert text == ("Hello world" if skip else "Hello world" + EOS)


def test_finish_flushes_an_incomplete_character(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("ok 🐙").ids[:-1]  # the emoji's last byte never comes
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.decode_next([t]) for t in token_ids)
    tail = detokenizer.finish()
    assert streamed.startswith("ok") and "\ufffd" not in streamed
    assert streamed + tail == tokenizer.decode(token_ids) and tail.endswith("\ufffd")
    assert detokenizer.finish() == ""


def test_finish_after_complete_text_adds_nothing(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.decode_next(tokenizer.encode("Hello world").ids) == "Hello world"
    assert detokenizer.finish() == "" and detokenizer.decode_next([]) == ""


def test_token_texts_equal_one_token_decodes(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode(TEXTS[2]).ids, tokenizer.token_to_id(EOS), 5, 5, 10**6]
    texts = TokenTexts(tokenizer)
    expected = [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
    assert texts.lookup(token_ids) == expected
    assert texts.lookup(token_ids[::-1]) == expected[::-1]  # from the cache
    assert texts.lookup([]) == []
