"""Incremental detokenization of generated text, and token texts for logprobs."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# How many prompt tokens seed the decode window (enough context for leading-space rules).
INITIAL_PREFIX_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Contract: the concatenation of every delta (and :meth:`finish`) equals
    ``tokenizer.decode(output_token_ids)`` for byte-level and sentencepiece-style tokenizers,
    with the leading-space rule resolved as if the prompt preceded the output. Text whose last
    character is an incomplete UTF-8 sequence (U+FFFD) is held back until the bytes complete.

    The stepping is ``tokenizers``' own ``DecodeStream`` (Rust), seeded with the prompt's last
    ``INITIAL_PREFIX_TOKENS`` tokens. ``DecodeStream`` never gives up held-back bytes, so
    :meth:`finish` decodes the held-back tokens itself (after the last emitted ones, for
    context), as a final window.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.skip_special_tokens = skip_special_tokens  # drop special tokens from the text
        context = list(prompt_token_ids or [])[-INITIAL_PREFIX_TOKENS:]
        self._stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)
        self._emitted_tail = context  # the last tokens whose text is emitted (finish's context)
        self._held: list[int] = []  # tokens given since the last emitted text
        self.output_text = ""  # all text emitted so far

    def decode_next(self, new_token_ids: list[int]) -> str:
        """Append ``new_token_ids`` and return the newly completed text (maybe ``""``)."""
        if not new_token_ids:
            return ""
        self._held.extend(new_token_ids)
        delta = self._stream.step(self.tokenizer, new_token_ids)
        if delta is None:
            return ""
        self._emitted_tail = (self._emitted_tail + self._held)[-INITIAL_PREFIX_TOKENS:]
        self._held = []
        self.output_text += delta
        return delta

    def finish(self) -> str:
        """Flush held-back text (e.g. a trailing incomplete character) at the end of output."""
        if not self._held:
            return ""
        prefix_text = self._decode(self._emitted_tail)
        new_text = self._decode(self._emitted_tail + self._held)
        self._emitted_tail, self._held = [], []
        if len(new_text) <= len(prefix_text):
            return ""
        delta = new_text[len(prefix_text) :]
        self.output_text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class TokenTexts:
    """Each token's own text, special tokens kept (the ``decoded_token`` of logprobs entries):
    the ids not seen before are decoded in one batch call, then remembered (at most one string
    per vocabulary entry)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # token id -> its text

    def lookup(self, token_ids: list[int]) -> list[str]:
        missing = list({t for t in token_ids if t not in self._texts})
        if missing:
            texts = self.tokenizer.decode_batch([[t] for t in missing], skip_special_tokens=False)
            self._texts.update(zip(missing, texts, strict=True))
        return [self._texts[t] for t in token_ids]
