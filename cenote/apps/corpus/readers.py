"""Read a corpus as a stream of passages: JSONL, CSV, Parquet or plain text (one per line).

Readers never hold more than one chunk of the input; every bad record is a ``CorpusError``
that names the file and the line (JSONL, text) or data row (CSV, Parquet). CSV and Parquet go
through pyarrow's streaming readers; JSONL lines through msgspec.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from cenote.errors import CenoteError

InputFormat = Literal["jsonl", "csv", "parquet", "text"]
INPUT_FORMATS: tuple[str, ...] = ("jsonl", "csv", "parquet", "text")
_SUFFIXES: dict[str, InputFormat] = {
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
    ".parquet": "parquet", ".pq": "parquet", ".txt": "text", ".text": "text",
}  # fmt: skip
_READ_BYTES = 1 << 20  # read size of pyarrow's CSV blocks and the row counter


class CorpusError(CenoteError, ValueError):
    """Bad corpus input or output; the message names the file and the line or row."""


@dataclass(frozen=True)
class CorpusSource:
    """Where the passages come from and which fields hold them."""

    path: Path
    format: InputFormat
    text_field: str = "text"  # JSONL key / CSV or Parquet column of the passage
    id_field: str | None = None  # None: a passage's id is its 0-based row number

    def location(self, row: int) -> str:
        """Where row ``row`` (0-based) is, in the words of its format."""
        if self.format in ("jsonl", "text"):
            return f"{self.path} line {row + 1}"
        return f"{self.path} row {row + 1}"


@dataclass
class Chunk:
    """Consecutive passages of the input."""

    first_row: int  # 0-based row number of texts[0]
    texts: list[str]
    ids: list[str] | None  # None: ids are the row numbers


def open_source(
    path: str | Path,
    text_field: str = "text",
    id_field: str | None = None,
    input_format: InputFormat | None = None,
) -> CorpusSource:
    """Check that ``path`` is a readable file and settle its format (from the suffix if not
    given: .jsonl/.json/.ndjson, .csv, .parquet/.pq, else text)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise CorpusError(f"cannot read {path}: {e.strerror or e}") from e
    if input_format is None:
        input_format = _SUFFIXES.get(path.suffix.lower(), "text")
    if input_format not in INPUT_FORMATS:
        raise CorpusError(f"unknown input format {input_format!r}; choose one of {INPUT_FORMATS}")
    if input_format == "text" and id_field is not None:
        raise CorpusError(f"{path} is plain text (one passage a line): it has no id field")
    return CorpusSource(path, input_format, text_field, id_field)


def read_chunks(source: CorpusSource, chunk_rows: int) -> Iterator[Chunk]:
    """The passages in input order, ``chunk_rows`` at a time (the last chunk may be shorter)."""
    readers = {"jsonl": _jsonl, "text": _text, "csv": _csv, "parquet": _parquet}
    texts: list[str] = []
    ids: list[str] = []
    first_row = 0
    for batch_texts, batch_ids in readers[source.format](source, chunk_rows):
        texts.extend(batch_texts)
        if batch_ids is not None:
            ids.extend(batch_ids)
        while len(texts) >= chunk_rows:
            yield Chunk(first_row, texts[:chunk_rows], ids[:chunk_rows] if ids else None)
            texts, ids = texts[chunk_rows:], ids[chunk_rows:]
            first_row += chunk_rows
    if texts:
        yield Chunk(first_row, texts, ids or None)


def count_rows(source: CorpusSource) -> int | None:
    """The number of passages, when it is cheap to know (Parquet metadata; newlines of JSONL
    and text files); None for CSV (quoted fields may span lines)."""
    if source.format == "parquet":
        num_rows: int = _parquet_file(source).metadata.num_rows
        return num_rows
    if source.format == "csv":
        return None
    count, last = 0, b"\n"
    with open(source.path, "rb") as f:
        while block := f.read(_READ_BYTES):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


# ---- formats ----------------------------------------------------------------------------------

Batch = tuple[list[str], list[str] | None]


def _lines(source: CorpusSource) -> Iterator[tuple[int, str]]:
    """(0-based row, line without its newline); an empty line is an error."""
    with open(source.path, "rb") as f:
        for row, raw in enumerate(f):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise CorpusError(f"{source.location(row)} is not valid UTF-8: {e}") from e
            if not line.strip():
                raise CorpusError(
                    f"{source.location(row)} is empty; every line must hold one passage"
                )
            yield row, line


def _text(source: CorpusSource, chunk_rows: int) -> Iterator[Batch]:
    texts: list[str] = []
    for _, line in _lines(source):
        texts.append(line)
        if len(texts) == chunk_rows:
            yield texts, None
            texts = []
    if texts:
        yield texts, None


def _jsonl(source: CorpusSource, chunk_rows: int) -> Iterator[Batch]:
    decoder = msgspec.json.Decoder()
    texts: list[str] = []
    ids: list[str] | None = [] if source.id_field is not None else None
    for row, line in _lines(source):
        try:
            record = decoder.decode(line)
        except msgspec.DecodeError as e:
            raise CorpusError(f"{source.location(row)} is not valid JSON: {e}") from e
        if not isinstance(record, dict):
            raise CorpusError(
                f"{source.location(row)} is a JSON {type(record).__name__}, not an object"
            )
        texts.append(_text_of(source, row, record.get(source.text_field), record))
        if ids is not None:
            ids.append(_id_of(source, row, record.get(source.id_field), record))
        if len(texts) == chunk_rows:
            yield texts, ids
            texts, ids = [], ([] if ids is not None else None)
    if texts:
        yield texts, ids


def _csv(source: CorpusSource, chunk_rows: int) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    columns = [source.text_field] + ([source.id_field] if source.id_field else [])
    convert = pcsv.ConvertOptions(
        include_columns=columns,
        column_types={c: pa.string() for c in columns},
        strings_can_be_null=False,
    )
    try:
        reader = pcsv.open_csv(
            source.path, read_options=pcsv.ReadOptions(block_size=_READ_BYTES),
            convert_options=convert,
        )  # fmt: skip
    except KeyError as e:  # pyarrow's ArrowKeyError: a column is missing
        raise CorpusError(f"{source.path}: {_missing_columns(source, _csv_header(source))}") from e
    except (OSError, ValueError) as e:
        raise CorpusError(f"{source.path} is not a readable CSV file: {e}") from e
    yield from _columnar_batches(source, reader, "CSV")


def _parquet(source: CorpusSource, chunk_rows: int) -> Iterator[Batch]:
    parquet = _parquet_file(source)
    names = parquet.schema_arrow.names
    columns = [source.text_field] + ([source.id_field] if source.id_field else [])
    if any(c not in names for c in columns):
        raise CorpusError(f"{source.path}: {_missing_columns(source, names)}")
    yield from _columnar_batches(
        source, parquet.iter_batches(batch_size=chunk_rows, columns=columns), "Parquet"
    )


def _columnar_batches(source: CorpusSource, batches: Any, kind: str) -> Iterator[Batch]:
    row = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise CorpusError(f"{source.path} near row {row + 1}: bad {kind} data: {e}") from e
        texts = batch.column(source.text_field).to_pylist()
        for i, text in enumerate(texts):
            _text_of(source, row + i, text, None)
        ids = None
        if source.id_field is not None:
            raw_ids = batch.column(source.id_field).to_pylist()
            ids = [_id_of(source, row + i, v, None) for i, v in enumerate(raw_ids)]
        row += len(texts)
        yield texts, ids


def _parquet_file(source: CorpusSource) -> Any:  # pyarrow.parquet.ParquetFile
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(source.path)
    except (OSError, ValueError) as e:
        raise CorpusError(f"{source.path} is not a readable Parquet file: {e}") from e


def _csv_header(source: CorpusSource) -> list[str]:
    import pyarrow.csv as pcsv

    names: list[str] = pcsv.open_csv(source.path).schema.names
    return names


# ---- records ----------------------------------------------------------------------------------


def _text_of(source: CorpusSource, row: int, text: Any, record: dict[str, Any] | None) -> str:
    if text is None:
        if record is not None and source.text_field not in record:
            fields = ", ".join(map(repr, record)) or "none"
            raise CorpusError(
                f"{source.location(row)} has no field {source.text_field!r} (its fields: "
                f"{fields}); pass --text-field"
            )
        raise CorpusError(f"{source.location(row)}: {source.text_field!r} is null")
    if not isinstance(text, str):
        raise CorpusError(
            f"{source.location(row)}: {source.text_field!r} is a {type(text).__name__}, not text"
        )
    if not text.strip():
        raise CorpusError(f"{source.location(row)}: {source.text_field!r} is empty")
    return text


def _id_of(source: CorpusSource, row: int, value: Any, record: dict[str, Any] | None) -> str:
    if value is None:
        missing = record is not None and source.id_field not in record
        what = f" has no field {source.id_field!r}" if missing else f": {source.id_field!r} is null"
        raise CorpusError(f"{source.location(row)}{what}")
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


def _missing_columns(source: CorpusSource, names: list[str]) -> str:
    wanted = [source.text_field] + ([source.id_field] if source.id_field else [])
    missing = [c for c in wanted if c not in names]
    return (
        f"no column {', '.join(map(repr, missing))} (its columns: {', '.join(map(repr, names))}); "
        "pass --text-field / --id-field"
    )
