"""Tokenization is safe from several threads (the server tokenizes off its event loop) and
truncates exactly as the tokenizer's own truncation does."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

TEXTS = ["one two three four five six seven eight nine ten " * 3, "short", "a b c d e f g h"]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_truncation_equals_the_tokenizers_own(llm_fp32, minilm_path, side, add_special_tokens):
    reference = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    reference.no_padding()
    reference.enable_truncation(7, direction=side)
    expected = [e.ids for e in reference.encode_batch(TEXTS, add_special_tokens=add_special_tokens)]
    got = llm_fp32.input_processor.tokenize(
        TEXTS, 7, truncation_side=side, add_special_tokens=add_special_tokens, is_pooling=False
    )
    assert [t.prompt_token_ids for t in got] == expected


def test_concurrent_tokenization_with_and_without_truncation(llm_fp32):
    processor = llm_fp32.input_processor
    long_text = "word " * 400
    full = processor.tokenize([long_text], -1)[0].prompt_token_ids
    cut = processor.tokenize([long_text], 16)[0].prompt_token_ids

    def one(i: int) -> list[int]:
        limit = 16 if i % 2 else -1
        return processor.tokenize([long_text], limit)[0].prompt_token_ids

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(200)))
    assert all(r == (cut if i % 2 else full) for i, r in enumerate(results))
    # the shared tokenizer was never left truncating
    assert processor.tokenizer.truncation is None
