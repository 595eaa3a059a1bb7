"""Stop strings of a generation request, all matched at once by one compiled pattern."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import NamedTuple


class StopMatch(NamedTuple):
    """Where a stop string was found and how to trim the output text."""

    stop_str: str  # the stop string that matched
    truncate_to: int  # keep output_text[:truncate_to]


class StopStrings:
    """A request's stop strings. ``find`` scans the new text once with one alternation of all
    of them (the leftmost match wins, and at one position the string listed first, as a loop
    over the list in order would pick); its cost grows with the new text and the longest
    string, not with how many strings there are."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.max_len = max((len(s) for s in self.stop), default=0)
        self._pattern = re.compile("|".join(map(re.escape, self.stop))) if self.stop else None

    def find(self, text: str, new_delta_len: int, include_stop_str: bool) -> StopMatch | None:
        """The earliest stop string that ends inside the last ``new_delta_len`` characters
        (older text was checked before). ``truncate_to`` cuts before the stop string, or after
        it when ``include_stop_str``."""
        if new_delta_len <= 0 or self._pattern is None:
            return None
        # a match ending in the new text starts no earlier than this
        start = max(len(text) - new_delta_len - self.max_len + 1, 0)
        found = self._pattern.search(text, start)
        if found is None:
            return None
        if found.end() <= len(text) - new_delta_len:
            # a string wholly inside the old text, which was never checked (not the engine's
            # case: it checks every delta): string by string, as the contract reads
            return self._find_each(text, new_delta_len, include_stop_str)
        end = found.end() if include_stop_str else found.start()
        return StopMatch(stop_str=found.group(), truncate_to=end)

    def _find_each(self, text: str, new_delta_len: int, include_stop_str: bool) -> StopMatch | None:
        best: StopMatch | None = None
        best_index = len(text) + 1
        for stop_str in self.stop:
            index = text.find(stop_str, max(len(text) - new_delta_len - len(stop_str) + 1, 0))
            if index == -1 or index >= best_index:
                continue
            best_index = index
            end = index + len(stop_str) if include_stop_str else index
            best = StopMatch(stop_str=stop_str, truncate_to=end)
        return best

    def holdback(self, text: str) -> int:
        """Characters at the end of ``text`` that could start a stop string (held back when
        streaming, so a client never sees a stop string's prefix that is later removed)."""
        if not text:
            return 0
        last, longest = text[-1], 0
        for stop_str in self.stop:
            # candidate prefix lengths n end with text's last character, longest first
            n = stop_str.rfind(last, 0, min(len(stop_str) - 1, len(text)))
            while n + 1 > longest:
                if text.endswith(stop_str[: n + 1]):
                    longest = n + 1
                    break
                n = stop_str.rfind(last, 0, n)
        return longest


@lru_cache(maxsize=256)
def stop_strings(stop: tuple[str, ...]) -> StopStrings:
    """The matcher of ``stop`` (shared by a request's n completions and repeated requests)."""
    return StopStrings(stop)
