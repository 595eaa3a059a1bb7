"""Texts and token-id prompts: the parity corpus (short, punctuation, unicode, numbers, code,
prose, longer than 256 tokens), prose passages, and seeded random prompts."""

from __future__ import annotations

import torch

from .vocab import NUM_SPECIAL_TOKENS, VOCAB_SIZE

PROSE = [
    # Jane Austen, Pride and Prejudice (1813)
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters.",
    # Herman Melville, Moby-Dick (1851)
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money "
    "in my purse, and nothing particular to interest me on shore, I thought I would sail about a "
    "little and see the watery part of the world. It is a way I have of driving off the spleen "
    "and regulating the circulation.",
    # Charles Dickens, A Tale of Two Cities (1859)
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the "
    "winter of despair.",
    # Lewis Carroll, Alice's Adventures in Wonderland (1865)
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading, but it "
    "had no pictures or conversations in it, 'and what is the use of a book,' thought Alice "
    "'without pictures or conversations?'",
]

_LONG = " ".join(PROSE)  # ~230 words: > 256 tokens once doubled

PARITY_TEXTS: list[str] = [
    # short
    "hello",
    "Hi!",
    "a",
    "OK",
    "The cat sat on the mat.",
    "What is the capital of France?",
    "Paris is the capital of France.",
    "search_query: best pizza near me",
    "I love this product, it works great.",
    "This is terrible; I want a refund.",
    # punctuation and casing
    "!!!???...,,,;;;:::",
    "Wait -- what?! (No way...) [really] {yes}",
    "\"Quoted\" 'single' `backtick` «guillemets» „low-high“",
    "ALL CAPS SENTENCE WITH SHOUTING",
    "mIxEd CaSe wOrDs ArE wEiRd",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\nmixed",
    "e-mail: someone@example.com, url: https://example.org/a?b=c&d=e#f",
    "#hashtag @mention $TICKER %percent ^caret &amp *star",
    "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p",
    # unicode
    "Café crème brûlée à la française, naïve façade.",
    "Zürich, München, Köln und Düsseldorf liegen in Europa.",
    "¿Dónde está la biblioteca? ¡Aquí está!",
    "Москва — столица России.",
    "東京は日本の首都です。",
    "北京是中国的首都。",
    "서울은 한국의 수도입니다.",
    "القاهرة هي عاصمة مصر.",
    "नई दिल्ली भारत की राजधानी है।",
    "Emoji test 😀🎉👍🏽 🇫🇷 ❤️",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = ∫ f(x) dx ≈ π",
    "Ελληνικά: Αθήνα είναι η πρωτεύουσα.",
    # numbers
    "1234567890",
    "3.14159265358979323846264338327950288419716939937510",
    "The meeting is on 2024-03-15 at 14:30 UTC+01:00.",
    "Invoice #00042: total $1,299.99 (incl. 20% VAT), due in 30 days.",
    "0x1F 0b1010 0o777 1e-10 6.022e23 -273.15",
    "Call +1 (555) 010-9999 or +44 20 7946 0958.",
    # code
    "def add(a, b):\n    return a + b",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "SELECT name, COUNT(*) FROM users WHERE age > 21 GROUP BY name ORDER BY 2 DESC;",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    '<div class="container"><p>Hello &amp; welcome</p></div>',
    "git commit -m 'fix: handle None in parser' && git push origin main",
    "import torch; x = torch.randn(3, 4) @ torch.randn(4, 5)",
    # medium prose
    *PROSE,
    "Machine learning models map inputs to outputs by learning parameters from data, and "
    "embedding models map sentences to vectors so that similar meanings land close together.",
    "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.",
    # long: more than 256 tokens (truncated by sentence-transformers to 256)
    _LONG + " " + _LONG,
    (_LONG + " ") * 4,
    " ".join(reversed(_LONG.split())) + " " + _LONG,
    ("token " * 600).strip(),
    "x = 1\n" * 300,
]


def random_prompts(
    lengths: list[int], seed: int = 0, low: int = NUM_SPECIAL_TOKENS, high: int = VOCAB_SIZE
) -> list[list[int]]:
    """Token-id prompts of the given lengths, ids in ``[low, high)`` (by default free of
    special and padding ids of the tiny encoders)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=generator).tolist() for n in lengths]


def embed_matrix(llm, texts: list, **kwargs) -> torch.Tensor:
    """cenote embeddings of ``texts`` as one fp32 matrix [num_texts, dim]."""
    return torch.stack([out.outputs.data.float() for out in llm.embed(texts, **kwargs)])
