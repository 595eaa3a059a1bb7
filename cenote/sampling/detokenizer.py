"""Incremental detokenization and stop-string matching for generated text."""

from __future__ import annotations

from typing import NamedTuple

from tokenizers import Tokenizer

# How many prompt tokens seed the decode window (enough context for leading-space rules).
INITIAL_PREFIX_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Contract: the concatenation of every delta (and :meth:`finish`) equals
    ``tokenizer.decode(output_token_ids)`` for byte-level and sentencepiece-style tokenizers,
    with the leading-space rule resolved as if the prompt preceded the output. Text whose last
    character is an incomplete UTF-8 sequence (U+FFFD) is held back until the bytes complete.

    Technique: decode a short window ``ids[prefix_offset:]`` and subtract the already emitted
    ``ids[prefix_offset:read_offset]`` text, so context-dependent decoding (spaces, merged
    bytes) is right without re-decoding the whole sequence.
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
        self.token_ids: list[int] = context  # decode context: prompt tail + output so far
        self.prefix_offset = 0  # start of the decode window in token_ids
        self.read_offset = len(context)  # tokens before this are already emitted as text
        self.output_text = ""  # all text emitted so far

    def decode_next(self, new_token_ids: list[int]) -> str:
        """Append ``new_token_ids`` and return the newly completed text (maybe ``""``)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def finish(self) -> str:
        """Flush held-back text (e.g. a trailing incomplete character) at the end of output."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


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
