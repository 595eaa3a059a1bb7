"""The Batch API's state in one SQLite database (stdlib ``sqlite3``) under ``--batch-dir``: the
files (their bytes are files beside it, ``files/<id>.jsonl``), the batches, and one row per
finished input line. Each line's result is committed on its own, so a server killed mid-job
loses no finished line and a restart runs only the lines without a row (the primary key
``(batch_id, line_number)`` keeps every line's result exactly once).

Every method is blocking: the server calls them on one thread of their own (``BatchStore`` is
used by a single thread at a time), never on the event loop. The database runs in WAL mode with
``synchronous=NORMAL``: a commit survives the process being killed (the WAL is in the OS's
page cache); only a power loss may drop the last commits.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
    "cancelled",
]  # fmt: skip
UNFINISHED: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")
COMPLETION_WINDOW_S = 24 * 3600  # "24h", the only window OpenAI offers

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, num_lines INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    metadata TEXT, errors TEXT, output_file_id TEXT, error_file_id TEXT,
    total INTEGER NOT NULL, created_at INTEGER NOT NULL, in_progress_at INTEGER,
    expires_at INTEGER NOT NULL, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line_number INTEGER NOT NULL, ok INTEGER NOT NULL,
    data BLOB NOT NULL, PRIMARY KEY (batch_id, line_number)) WITHOUT ROWID;
"""
_TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
               "failed_at", "expired_at", "cancelling_at", "cancelled_at")  # fmt: skip


@dataclass(frozen=True)
class StoredFile:
    id: str
    purpose: str  # "batch" (uploaded) or "batch_output" (a batch's output or error file)
    filename: str
    bytes: int
    num_lines: int
    created_at: int  # unix seconds

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's File object."""
        return {
            "id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
            "expires_at": None, "filename": self.filename, "purpose": self.purpose,
            "status": "processed", "status_details": None,
        }  # fmt: skip


@dataclass(frozen=True)
class Batch:
    """One row of ``batches`` (what a job needs; ``BatchStore.to_openai`` renders the rest)."""

    id: str
    endpoint: str  # every line's url must be this one
    input_file_id: str
    status: BatchStatus
    total: int  # lines of the input file
    expires_at: int  # unix seconds


class BatchStore:
    """Files, batches and line results under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files_dir = directory / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # one server per folder: two would run the same batches
        self._lock = open(directory / "lock", "w")  # held until close()
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(
                f"--batch-dir {directory} is in use by another cenote server (it holds "
                f"{directory / 'lock'}); give each server its own folder"
            ) from None
        for leftover in self.files_dir.glob(".*"):  # uploads and outputs a crash cut short
            leftover.unlink()
        self.db = sqlite3.connect(directory / "batches.sqlite3", check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()
        self._lock.close()  # releases the folder

    # ---- files --------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def new_upload_path(self) -> Path:
        """Where an upload is written before ``add_file`` takes it (one a crash leaves behind
        is removed by the next start)."""
        return self.files_dir / f".upload-{uuid.uuid4().hex}"

    def add_file(
        self, upload: Path, purpose: str, filename: str, num_bytes: int, num_lines: int
    ) -> StoredFile:
        stored = StoredFile(
            f"file-{uuid.uuid4().hex}", purpose, filename, num_bytes, num_lines, int(time.time())
        )
        os.replace(upload, self.file_path(stored.id))
        with self.db:
            self.db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                (stored.id, purpose, filename, num_bytes, num_lines, stored.created_at),
            )
        return stored

    def get_file(self, file_id: str) -> StoredFile | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else StoredFile(**dict(row))

    def list_files(self) -> list[StoredFile]:
        rows = self.db.execute("SELECT * FROM files ORDER BY created_at DESC, id").fetchall()
        return [StoredFile(**dict(row)) for row in rows]

    def file_in_use(self, file_id: str) -> str | None:
        """The id of an unfinished batch reading ``file_id``, if any."""
        row = self.db.execute(
            f"SELECT id FROM batches WHERE input_file_id = ? AND status IN {UNFINISHED}",
            (file_id,),
        ).fetchone()
        return None if row is None else str(row["id"])

    def delete_file(self, file_id: str) -> None:
        with self.db:
            self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)

    # ---- batches ------------------------------------------------------------------------------

    def add_batch(
        self, endpoint: str, input_file: StoredFile, metadata: dict[str, str] | None
    ) -> str:
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        with self.db:
            seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            self.db.execute(
                "INSERT INTO batches (id, seq, endpoint, input_file_id, completion_window, "
                "status, metadata, total, created_at, expires_at) VALUES (?, ?, ?, ?, '24h', "
                "'validating', ?, ?, ?, ?)",
                (batch_id, seq, endpoint, input_file.id,
                 None if metadata is None else json.dumps(metadata), input_file.num_lines, now,
                 now + COMPLETION_WINDOW_S),
            )  # fmt: skip
        return batch_id

    def get_batch(self, batch_id: str) -> Batch | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else _batch(row)

    def next_unfinished(self) -> Batch | None:
        """The oldest batch not yet completed, failed, expired or cancelled."""
        row = self.db.execute(
            f"SELECT * FROM batches WHERE status IN {UNFINISHED} ORDER BY seq LIMIT 1"
        ).fetchone()
        return None if row is None else _batch(row)

    def move(self, batch_id: str, to: BatchStatus, *, only_from: tuple[BatchStatus, ...]) -> bool:
        """Set the status (and its ``<status>_at`` time) if the batch is in one of
        ``only_from``; False when it is not (e.g. a cancel came first)."""
        stamp = f", {to}_at = {int(time.time())}" if f"{to}_at" in _TIMESTAMPS else ""
        marks = ", ".join("?" * len(only_from))
        with self.db:
            cursor = self.db.execute(
                f"UPDATE batches SET status = ?{stamp} WHERE id = ? AND status IN ({marks})",
                (to, batch_id, *only_from),
            )
        return cursor.rowcount == 1

    def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        """A batch refused as a whole (nothing ran): OpenAI's ``errors`` list."""
        body = json.dumps({"object": "list", "data": errors})
        with self.db:
            self.db.execute(
                "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ?",
                (int(time.time()), body, batch_id),
            )

    def list_batches(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, those created before ``after``; and whether more follow."""
        where, args = "", tuple[str, ...]()
        if after is not None:
            where, args = "WHERE seq < (SELECT seq FROM batches WHERE id = ?)", (after,)
        rows = self.db.execute(
            f"SELECT * FROM batches {where} ORDER BY seq DESC LIMIT ?", (*args, limit + 1)
        ).fetchall()
        return [self._openai(row) for row in rows[:limit]], len(rows) > limit

    def to_openai(self, batch_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else self._openai(row)

    def _openai(self, row: sqlite3.Row) -> dict[str, Any]:
        """OpenAI's Batch object; ``request_counts`` counted from the stored results."""
        completed, failed = self.counts(row["id"])
        body: dict[str, Any] = {
            "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": None if row["errors"] is None else json.loads(row["errors"]),
            "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"], "status": row["status"],
            "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        }  # fmt: skip
        body.update({name: row[name] for name in _TIMESTAMPS})
        body["request_counts"] = {"total": row["total"], "completed": completed, "failed": failed}
        body["metadata"] = None if row["metadata"] is None else json.loads(row["metadata"])
        return body

    # ---- line results -------------------------------------------------------------------------

    def record(self, batch_id: str, line_number: int, ok: bool, data: bytes) -> None:
        """One finished line, in its own transaction (a repeat of a stored line is ignored)."""
        with self.db:
            self.db.execute(
                "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                (batch_id, line_number, int(ok), data),
            )

    def done_lines(self, batch_id: str) -> set[int]:
        rows = self.db.execute("SELECT line_number FROM results WHERE batch_id = ?", (batch_id,))
        return {row[0] for row in rows}

    def counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed) lines so far."""
        row = self.db.execute(
            "SELECT COALESCE(SUM(ok), 0), COUNT(*) - COALESCE(SUM(ok), 0) FROM results "
            "WHERE batch_id = ?",
            (batch_id,),
        ).fetchone()
        return int(row[0]), int(row[1])

    def finalize(self, batch_id: str, to: Literal["completed", "cancelled", "expired"]) -> None:
        """Write the output file (successful lines) and the error file (failed ones), in input
        order, register them and set the final status, in one transaction. The files' ids come
        from the batch's, so finalizing again after a crash rewrites the same files."""
        file_ids: dict[bool, str | None] = {}
        now = int(time.time())
        rows: list[tuple[Any, ...]] = []
        for ok, kind in ((True, "output"), (False, "error")):
            file_id = f"file-{batch_id.removeprefix('batch_')}-{kind}"
            num_bytes, num_lines = self._write_results(batch_id, ok, self.file_path(file_id))
            if num_lines == 0:
                self.file_path(file_id).unlink()
                file_ids[ok] = None
                continue
            file_ids[ok] = file_id
            name = f"{batch_id}_{kind}.jsonl"
            rows.append((file_id, "batch_output", name, num_bytes, num_lines, now))
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)", rows)
            self.db.execute(
                f"UPDATE batches SET status = ?, {to}_at = ?, output_file_id = ?, "
                "error_file_id = ? WHERE id = ?",
                (to, now, file_ids[True], file_ids[False], batch_id),
            )

    def _write_results(self, batch_id: str, ok: bool, path: Path) -> tuple[int, int]:
        tmp = path.with_name(f".{path.name}.tmp")
        num_bytes = num_lines = 0
        with open(tmp, "wb") as out:
            for data in self._results(batch_id, ok):
                out.write(data + b"\n")
                num_bytes += len(data) + 1
                num_lines += 1
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        return num_bytes, num_lines

    def _results(self, batch_id: str, ok: bool) -> Iterator[bytes]:
        rows = self.db.execute(
            "SELECT data FROM results WHERE batch_id = ? AND ok = ? ORDER BY line_number",
            (batch_id, int(ok)),
        )
        for row in rows:
            yield bytes(row[0])


def _batch(row: sqlite3.Row) -> Batch:
    return Batch(
        row["id"], row["endpoint"], row["input_file_id"], row["status"], row["total"],
        row["expires_at"],
    )  # fmt: skip
