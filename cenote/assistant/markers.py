"""Finding a marker (``<tool_call>``, ``</think>``) in streamed text that may split it."""

from __future__ import annotations


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of a marker: that
    much must be held back, it may grow into the marker with the next delta."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def find_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The first position of any marker in ``text`` and which one, or (-1, "")."""
    best, found = -1, ""
    for marker in markers:
        position = text.find(marker)
        if position >= 0 and (best < 0 or position < best):
            best, found = position, marker
    return best, found


def could_open(text: str, markers: tuple[str, ...]) -> bool:
    """Whether ``text`` is a proper beginning of a marker (more text may complete it)."""
    return any(len(text) < len(m) and m.startswith(text) for m in markers)
