"""What reaches the tokenizer: the characters of every call, recorded."""

from __future__ import annotations

import pytest

from cenote.engine.prompt_tokenizer import PromptTokenizer


def record_tokenized(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The characters the prompt tokenizer encodes, a call at a time (from now on)."""
    calls: list[int] = []
    encode = PromptTokenizer._encode

    def spy(self, texts, *args, **kwargs):
        calls.append(sum(map(len, texts)))
        return encode(self, texts, *args, **kwargs)

    monkeypatch.setattr(PromptTokenizer, "_encode", spy)
    return calls
