"""Incremental detokenization and stop-string matching for generated text."""

from __future__ import annotations

from typing import NamedTuple

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


class StopMatch(NamedTuple):
    """Where a stop string was found and how to trim the output text."""

    stop_str: str  # the stop string that matched
    truncate_to: int  # keep output_text[:truncate_to]


def check_stop_strings(
    text: str, new_delta_len: int, stop: list[str], include_stop_str_in_output: bool
) -> StopMatch | None:
    """Find the earliest stop string that ends inside the last ``new_delta_len`` characters.

    Only matches overlapping the new text are considered (older text was checked before).
    ``truncate_to`` cuts before the stop string, or after it when
    ``include_stop_str_in_output``.
    """
    if new_delta_len <= 0 or not stop:
        return None
    best: StopMatch | None = None
    best_index = len(text) + 1
    for stop_str in stop:
        # A new match must end after the old text: start no earlier than this.
        search_from = max(len(text) - new_delta_len - len(stop_str) + 1, 0)
        index = text.find(stop_str, search_from)
        if index == -1 or index >= best_index:
            continue
        best_index = index
        end = index + len(stop_str) if include_stop_str_in_output else index
        best = StopMatch(stop_str=stop_str, truncate_to=end)
    return best


def stop_holdback_len(text: str, stop: list[str]) -> int:
    """Characters at the end of ``text`` that could start a stop string (hold them back when
    streaming, so a client never sees a stop string's prefix that is later removed)."""
    longest = 0
    for stop_str in stop:
        for n in range(min(len(stop_str) - 1, len(text)), longest, -1):
            if text.endswith(stop_str[:n]):
                longest = n
                break
    return longest
