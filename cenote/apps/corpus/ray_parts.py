"""``cenote embed --ray``: the corpus job's parts embedded by ``cenote.ray.Embedder`` actors
through Ray Data ``map_batches``. The driver reads the input (the same readers as the
single-process job), ships a window of parts to the cluster as Arrow blocks, and commits each
part as soon as all its rows are back (in order), so a killed run resumes as the local one does.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from cenote.apps.corpus.embedder import RowError
from cenote.apps.corpus.job import EmbedJob, chunk_ids
from cenote.apps.corpus.parts import PartResult
from cenote.apps.corpus.readers import Chunk


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: start a local Ray instance
    num_workers: int | None = None  # engines (actors); None: as many as the CPUs allow
    # CPUs (= torch threads) per engine: one engine per CPU runs fastest beside Ray's own
    # processes (docs/performance.md, "numbers out of code comments")
    cpus_per_worker: int = 1
    batch_size: int | None = None  # rows per map_batches call; None: a part
    window_parts: int = 64  # parts per Ray Data dataset (bounds what the driver holds)


class RayEmbedParts:
    """Embed pending parts on the Ray cluster; yields (chunk, result) in input order."""

    def __init__(self, job: EmbedJob, options: RayOptions) -> None:
        import ray

        from cenote.apps.ray import connect

        connect(options.address)
        nodes = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
        self.cpus_per_worker = options.cpus_per_worker
        fits = sum(int(n["Resources"].get("CPU", 0)) // self.cpus_per_worker for n in nodes)
        self.num_workers = options.num_workers or max(1, fits)
        self.job, self.options = job, options
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)

    def __call__(self, chunks: Iterator[Chunk]) -> Iterator[tuple[Chunk, PartResult]]:
        window: list[Chunk] = []
        for chunk in chunks:
            window.append(chunk)
            if len(window) == self.options.window_parts:
                yield from self._embed_window(window)
                window = []
        if window:
            yield from self._embed_window(window)

    def _embed_window(self, window: list[Chunk]) -> Iterator[tuple[Chunk, PartResult]]:
        import pyarrow as pa
        import ray

        from cenote.apps.ray import Embedder

        # 1) one Arrow block per part: (row, text)
        tables = [
            pa.table(
                {
                    "row": pa.array(range(c.first_row, c.first_row + len(c.texts)), pa.int64()),
                    "text": pa.array(c.texts, pa.string()),
                }
            )
            for c in window
        ]
        refs = [ray.put(t) for t in tables]
        # ray.put's ObjectRef and the one from_arrow_refs is annotated with are two classes
        dataset = ray.data.from_arrow_refs(refs).map_batches(  # type: ignore[arg-type]
            Embedder,
            fn_constructor_kwargs={
                **self.job.llm_kwargs(),
                "num_threads": self.cpus_per_worker,
                "truncate_prompt_tokens": self.job.truncate,
                "dimensions": self.job.dimensions,
                "drop_columns": ("text",),
            },
            compute=ray.data.ActorPoolStrategy(size=self.num_workers),
            num_cpus=self.cpus_per_worker,
            batch_size=self.options.batch_size or self.job.rows_per_part,
        )
        # 2) collect rows in order; a part is complete when all its rows are back
        collector = _PartCollector(window)
        try:
            for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
                yield from collector.add(batch["row"], batch["embedding"], batch["num_tokens"])
        except Exception as e:
            row_error = _row_error(e)
            if row_error is None:
                raise
            raise RowError(row_error.row, row_error.message) from e
        collector.check_done()


class _PartCollector:
    def __init__(self, window: list[Chunk]) -> None:
        self.window = list(window)
        self.rows: list[np.ndarray] = []
        self.embeddings: list[np.ndarray] = []
        self.num_tokens: list[np.ndarray] = []
        self.num_buffered = 0

    def add(
        self, rows: np.ndarray, embeddings: np.ndarray, num_tokens: np.ndarray
    ) -> Iterator[tuple[Chunk, PartResult]]:
        self.rows.append(rows)
        self.embeddings.append(np.asarray(embeddings, dtype=np.float32))
        self.num_tokens.append(num_tokens)
        self.num_buffered += len(rows)
        while self.window and self.num_buffered >= len(self.window[0].texts):
            chunk = self.window.pop(0)
            n = len(chunk.texts)
            rows_all, emb_all, tok_all = (
                np.concatenate(x) for x in (self.rows, self.embeddings, self.num_tokens)
            )
            expected = np.arange(chunk.first_row, chunk.first_row + n)
            if not np.array_equal(rows_all[:n], expected):
                raise RuntimeError(
                    f"Ray returned rows out of order for the part at row {chunk.first_row}"
                )
            self.rows, self.embeddings, self.num_tokens = (
                [rows_all[n:]],
                [emb_all[n:]],
                [tok_all[n:]],
            )
            self.num_buffered -= n
            yield chunk, PartResult(chunk_ids(chunk), emb_all[:n], tok_all[:n].astype(np.int32))

    def check_done(self) -> None:
        if self.window or self.num_buffered:
            raise RuntimeError(
                f"Ray returned {self.num_buffered} rows too many or left "
                f"{len(self.window)} parts unfinished"
            )


def _row_error(error: BaseException) -> RowError | None:
    """The ``RowError`` a worker raised. Ray Data re-raises a worker's exception as a
    ``UserCodeException`` that keeps only the text of its cause, so read it from there."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        found = _ROW_ERROR.search(str(current))
        if found is not None:
            return RowError(int(found["row"]), found["message"])
        pending += [current.__cause__, current.__context__]
    return None


_ROW_ERROR = re.compile(r"RowError: row (?P<row>\d+): (?P<message>[^\n]*)")
