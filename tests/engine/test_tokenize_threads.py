"""Tokenization is safe from several threads (the server tokenizes off its event loop) and
truncates exactly as the tokenizer's own truncation does."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from cenote import PoolingParams

TEXTS = ["one two three four five six seven eight nine ten " * 3, "short", "a b c d e f g h"]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_truncation_equals_the_tokenizers_own(llm_fp32, minilm_path, side, add_special_tokens):
    reference = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    reference.no_padding()
    reference.enable_truncation(7, direction=side)
    expected = [e.ids for e in reference.encode_batch(TEXTS, add_special_tokens=add_special_tokens)]
    params = PoolingParams(task="embed", truncate_prompt_tokens=7, truncation_side=side)
    ids = [str(i) for i in range(len(TEXTS))]
    got = llm_fp32.input_processor.process_batch(
        ids, TEXTS, params, add_special_tokens=add_special_tokens
    )
    assert [r.prompt_token_ids for r in got] == expected


def test_concurrent_tokenization_with_and_without_truncation(llm_fp32):
    processor = llm_fp32.input_processor
    long_text = "word " * 400

    def tokens(limit: int) -> list[int]:
        params = PoolingParams(task="embed", truncate_prompt_tokens=limit)
        return processor.process("r", long_text, params).prompt_token_ids

    full, cut = tokens(-1), tokens(16)

    def one(i: int) -> list[int]:
        return tokens(16 if i % 2 else -1)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(200)))
    assert all(r == (cut if i % 2 else full) for i, r in enumerate(results))
    # the shared tokenizer was never left truncating
    assert processor.tokenizer.truncation is None
