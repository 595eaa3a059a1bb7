"""The output of a corpus job: numbered Parquet part files and a manifest, each committed
atomically, so a job killed at any instant (even ``kill -9``) resumes where it stopped.

A part is written to a hidden temporary file, fsynced and renamed into place (``os.replace``);
only then is it recorded in ``_manifest.json`` (written the same way). A part counts as done only
when the manifest lists it and its file exists, so a rerun redoes at most the part in flight.
The directory is a Parquet dataset: ``pyarrow.parquet.read_table(directory)`` reads every row in
order (files whose names start with ``_`` or ``.`` are not data).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cenote.apps.corpus.readers import CorpusError

MANIFEST_NAME = "_manifest.json"
MANIFEST_VERSION = 1


@dataclass
class PartResult:
    """The embeddings of one part, in row order."""

    ids: list[str] | list[int]  # the id field's values, or the 0-based row numbers
    embeddings: np.ndarray  # [num_rows, dim] float32
    num_tokens: np.ndarray  # [num_rows] int32: tokens embedded (after truncation)


class PartStore:
    """Numbered part files of one job in ``directory``; ``job`` describes the job (input,
    fields, model, options) and must match the manifest of an earlier run to resume it."""

    def __init__(self, directory: Path, job: dict[str, Any]) -> None:
        self.directory = directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CorpusError(f"cannot create the output directory {directory}: {e}") from e
        self._manifest_path = directory / MANIFEST_NAME
        self._state = self._load_or_start(job)
        for stale in directory.glob(".*.tmp"):  # a write interrupted by a kill
            stale.unlink()

    def _load_or_start(self, job: dict[str, Any]) -> dict[str, Any]:
        if not self._manifest_path.exists():
            if any(self.directory.glob("part-*.parquet")):
                raise CorpusError(
                    f"{self.directory} holds part files but no {MANIFEST_NAME}; "
                    "choose an empty output directory"
                )
            new: dict[str, Any] = {
                "version": MANIFEST_VERSION, "job": job, "parts": {}, "num_rows": None
            }  # fmt: skip
            self._write_json(self._manifest_path, new)
            return new
        try:
            state: dict[str, Any] = json.loads(self._manifest_path.read_text())
        except (OSError, ValueError) as e:
            raise CorpusError(f"cannot read the manifest {self._manifest_path}: {e}") from e
        if state.get("job") != job:
            changed = sorted(
                k for k in set(job) | set(state.get("job", {})) if state["job"].get(k) != job.get(k)
            )
            raise CorpusError(
                f"{self.directory} holds the output of a different job (changed: "
                f"{', '.join(changed)}); rerun with the same input and options to resume, or "
                "write to a new output"
            )
        return state

    # ---- parts --------------------------------------------------------------------------------

    @property
    def num_parts_done(self) -> int:
        return len(self._state["parts"])

    @property
    def complete(self) -> bool:
        return self._state["num_rows"] is not None

    def is_done(self, index: int, first_row: int, num_rows: int) -> bool:
        record = self._state["parts"].get(str(index))
        return (
            record is not None
            and record["first_row"] == first_row
            and record["num_rows"] == num_rows
            and (self.directory / record["file"]).exists()
        )

    def commit(self, index: int, first_row: int, result: PartResult) -> None:
        """Write part ``index`` atomically, then record it in the manifest."""
        import pyarrow.parquet as pq

        name = part_name(index)
        tmp = self.directory / f".{name}.tmp"
        pq.write_table(_part_table(result), tmp)
        _fsync(tmp)
        os.replace(tmp, self.directory / name)
        self._state["parts"][str(index)] = {
            "file": name,
            "first_row": first_row,
            "num_rows": len(result.ids),
            "num_tokens": int(result.num_tokens.sum()),
        }
        self._write_json(self._manifest_path, self._state)

    def finish(self, num_rows: int) -> None:
        """Record that every row of the input is in a committed part."""
        self._state["num_rows"] = num_rows
        self._write_json(self._manifest_path, self._state)

    def part_paths(self) -> list[Path]:
        parts = sorted(self._state["parts"].values(), key=lambda p: p["first_row"])
        return [self.directory / p["file"] for p in parts]

    def _write_json(self, path: Path, value: dict[str, Any]) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(value, indent=1))
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync_directory(self.directory)


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


def export_npy(store: PartStore, npy_path: Path) -> Path:
    """Concatenate the parts into ``npy_path`` ([num_rows, dim] float32) and the ids and token
    counts into ``<stem>.ids.parquet``, one part at a time; both replaced atomically."""
    import pyarrow.parquet as pq

    paths = store.part_paths()
    assert paths, "a finished job has at least one part"
    num_rows = sum(pq.ParquetFile(p).metadata.num_rows for p in paths)
    dim = pq.read_schema(paths[0]).field("embedding").type.list_size
    ids_path = npy_path.with_name(npy_path.stem + ".ids.parquet")
    tmp_npy = npy_path.with_name(f".{npy_path.name}.tmp")
    tmp_ids = ids_path.with_name(f".{ids_path.name}.tmp")
    array = np.lib.format.open_memmap(tmp_npy, mode="w+", dtype=np.float32, shape=(num_rows, dim))
    row, writer = 0, None
    try:
        for table in _tables(paths):
            n = table.num_rows
            array[row : row + n] = _embedding_matrix(table)
            row += n
            ids = table.drop_columns(["embedding"])
            if writer is None:
                writer = pq.ParquetWriter(tmp_ids, ids.schema)
            writer.write_table(ids)
        array.flush()
    finally:
        if writer is not None:
            writer.close()
    del array
    os.replace(tmp_npy, npy_path)
    os.replace(tmp_ids, ids_path)
    return ids_path


def _tables(paths: list[Path]) -> Iterator[Any]:  # pyarrow tables
    import pyarrow.parquet as pq

    for path in paths:
        yield pq.read_table(path)


def _embedding_matrix(table: Any) -> np.ndarray:
    """[num_rows, dim] float32 from a part's fixed-size-list column (a pyarrow table's)."""
    column = table.column("embedding").combine_chunks()
    dim = column.type.list_size
    matrix: np.ndarray = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
    return matrix


def _part_table(result: PartResult) -> Any:  # a pyarrow table
    import pyarrow as pa

    embeddings = np.ascontiguousarray(result.embeddings, dtype=np.float32)
    dim = embeddings.shape[1] if embeddings.ndim == 2 else 0
    id_type = pa.int64() if all(isinstance(i, int) for i in result.ids) else pa.string()
    return pa.table(
        {
            "id": pa.array(result.ids, type=id_type),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1)), dim),
            "num_tokens": pa.array(result.num_tokens, type=pa.int32()),
        }
    )


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
