"""Reading a batch file with bounded memory: a line is held only up to ``max_line_bytes`` (a
longer one is skipped and reported on its own line), a chunk up to a number of lines and bytes;
and the file-level check OpenAI makes at upload: every custom_id appears once."""

from __future__ import annotations

import hashlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

from cenote.errors import CenoteError
from cenote.server.batch_lines import custom_id_of

_DRAIN_BYTES = 1 << 20  # read size while skipping the rest of a line that is too long
_NUM_REPEATS_NAMED = 5  # repeated custom_ids a refusal lists


class BatchFileError(CenoteError, ValueError):
    """The batch file as a whole is refused; nothing ran."""


@dataclass
class RawLine:
    """One line of the input file as read."""

    number: int  # 1-based line number
    data: bytes  # the line (b"" when it was longer than the bound, so not kept)
    num_bytes: int  # its length in the file, newline included

    @property
    def too_long(self) -> bool:
        return not self.data  # a line read is never b"": an empty one is b"\n"


def read_lines(path: Path, max_line_bytes: int) -> Generator[RawLine, None, None]:
    """Every line of ``path`` in order; one of more than ``max_line_bytes`` bytes (its newline
    not counted) is read past in pieces and comes back ``too_long``."""
    with open(path, "rb") as f:
        number = 0
        while data := f.readline(max_line_bytes + 1):
            number += 1
            if len(data) <= max_line_bytes or data.endswith(b"\n"):
                yield RawLine(number, data, len(data))
                continue
            num_bytes = len(data)
            while rest := f.readline(_DRAIN_BYTES):
                num_bytes += len(rest)
                if rest.endswith(b"\n"):
                    break
            yield RawLine(number, b"", num_bytes)


def read_chunks(
    path: Path, max_line_bytes: int, max_lines: int, max_bytes: int
) -> Iterator[list[RawLine]]:
    """The lines a chunk at a time: at most ``max_lines`` lines, and no more lines once a chunk
    holds ``max_bytes`` bytes."""
    chunk: list[RawLine] = []
    num_bytes = 0
    for line in read_lines(path, max_line_bytes):
        chunk.append(line)
        num_bytes += len(line.data)
        if len(chunk) >= max_lines or num_bytes >= max_bytes:
            yield chunk
            chunk, num_bytes = [], 0
    if chunk:
        yield chunk


def check_custom_ids(path: Path, max_line_bytes: int) -> None:
    """``BatchFileError`` naming the ids and their lines if two lines share a custom_id (lines
    without a readable one fail on their own when the batch runs)."""
    first_line: dict[bytes, int] = {}  # a digest of each custom_id -> the line it is on
    repeats: list[tuple[str, int, int]] = []  # (custom_id, first line, repeating line)
    num_repeats = 0
    for line in read_lines(path, max_line_bytes):
        custom_id = custom_id_of(line.data) if line.data else None
        if custom_id is None:
            continue
        key = hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16)
        first = first_line.setdefault(key.digest(), line.number)
        if first != line.number:
            num_repeats += 1
            if len(repeats) < _NUM_REPEATS_NAMED:
                repeats.append((custom_id, first, line.number))
    if repeats:
        named = "; ".join(
            f"{_shown(custom_id)} on line {first} and line {number}"
            for custom_id, first, number in repeats
        )
        more = f" (and {num_repeats - len(repeats)} more)" if num_repeats > len(repeats) else ""
        raise BatchFileError(
            f"{path}: {num_repeats} lines repeat an earlier line's custom_id: {named}{more}; "
            "every custom_id in a batch must be unique"
        )


def _shown(custom_id: str, limit: int = 80) -> str:
    return repr(custom_id if len(custom_id) <= limit else custom_id[:limit] + "...")
