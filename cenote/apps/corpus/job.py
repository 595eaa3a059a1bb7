"""``cenote embed``: embed a corpus into numbered part files, resumably, in this process or on a
Ray cluster (``cenote.ray``). Both paths read the input with the same readers, cut it into the
same parts and commit them through the same ``PartStore``; only who embeds a part differs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from cenote.apps.corpus.embedder import RowError, embed_passages
from cenote.apps.corpus.parts import PartResult, PartStore, export_npy
from cenote.apps.corpus.readers import Chunk, CorpusError, CorpusSource, count_rows, read_chunks

# embeds pending chunks; yields each with its result, in the order given
EmbedParts = Callable[[Iterator[Chunk]], Iterator[tuple[Chunk, PartResult]]]


@dataclass(frozen=True)
class EmbedJob:
    """One corpus job. The fields that change results are recorded in the manifest."""

    source: CorpusSource
    output: Path  # a directory of Parquet parts, or a .npy file (parts kept beside it)
    model: str | None = None  # None: the embedded all-MiniLM-L6-v2
    revision: str | None = None  # of a hub id in the local cache; None: main
    dtype: str = "auto"
    truncate: int | None = None  # None: a too-long passage is an error; -1: the model's limit
    dimensions: int | None = None  # matryoshka truncation
    rows_per_part: int = 1024
    max_tokens_per_batch: int | None = None  # the engine's token budget per step
    num_threads: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.rows_per_part < 1:
            raise CorpusError(f"rows per part must be positive, got {self.rows_per_part}")

    @property
    def exports_npy(self) -> bool:
        return self.output.suffix == ".npy"

    @property
    def parts_directory(self) -> Path:
        return (
            self.output.with_name(self.output.name + ".parts") if self.exports_npy else self.output
        )

    def manifest_job(self) -> dict[str, Any]:
        """What must not change between a run and its resumption."""
        stat = self.source.path.stat()
        return {
            "input": str(self.source.path.resolve()),
            "input_bytes": stat.st_size,
            "input_mtime_ns": stat.st_mtime_ns,
            **{k: v for k, v in asdict(self.source).items() if k != "path"},
            "model": self.model,
            # only when given: manifests written before the option existed still resume
            **({"revision": self.revision} if self.revision is not None else {}),
            "dtype": self.dtype,
            "truncate": self.truncate,
            "dimensions": self.dimensions,
            "rows_per_part": self.rows_per_part,
        }

    def llm_kwargs(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "revision": self.revision,
            "dtype": self.dtype,
            "max_num_batched_tokens": self.max_tokens_per_batch,
            "num_threads": self.num_threads,
        }


@dataclass
class JobSummary:
    num_rows: int
    num_parts: int
    num_parts_skipped: int  # done by an earlier run
    num_tokens: int  # embedded by this run
    seconds: float
    output: Path


def run_embed_job(job: EmbedJob, embed_parts: EmbedParts | None = None) -> JobSummary:
    """Embed every part not committed yet; ``embed_parts`` defaults to this process."""
    started = time.monotonic()
    # 1) open the output (resuming an earlier run of the same job) and count the input
    store = PartStore(job.parts_directory, job.manifest_job())
    total = count_rows(job.source)
    if embed_parts is None:
        embed_parts = LocalEmbedParts(job)
    progress = _Progress(total, job.progress)
    scan = _Scan(job, store, progress)
    # 2) embed the parts not done yet, committing each as it comes back
    num_tokens = 0
    try:
        for chunk, result in embed_parts(scan.pending()):
            store.commit(chunk.first_row // job.rows_per_part, chunk.first_row, result)
            num_tokens += int(result.num_tokens.sum())
            progress.update(len(chunk.texts), int(result.num_tokens.sum()))
    except RowError as e:
        raise CorpusError(f"{job.source.location(e.row)}: {e.message}") from e
    finally:
        progress.close()
    # 3) mark the job complete; export .npy + ids when asked
    if scan.num_rows == 0:
        raise CorpusError(f"{job.source.path} holds no passages")
    store.finish(scan.num_rows)
    if job.exports_npy:
        export_npy(store, job.output)
    return JobSummary(
        scan.num_rows, scan.num_parts, scan.num_skipped, num_tokens,
        time.monotonic() - started, job.output,
    )  # fmt: skip


class LocalEmbedParts:
    """Embed parts one after the other with one ``LLM`` in this process."""

    def __init__(self, job: EmbedJob) -> None:
        from cenote.llm import LLM

        self.job = job
        self.llm = LLM(**job.llm_kwargs())

    def __call__(self, chunks: Iterator[Chunk]) -> Iterator[tuple[Chunk, PartResult]]:
        for chunk in chunks:
            rows = range(chunk.first_row, chunk.first_row + len(chunk.texts))
            embeddings, num_tokens = embed_passages(
                self.llm, chunk.texts, rows, self.job.truncate, self.job.dimensions
            )
            yield chunk, PartResult(chunk_ids(chunk), embeddings, num_tokens)


def chunk_ids(chunk: Chunk) -> list[str] | list[int]:
    if chunk.ids is not None:
        return chunk.ids
    return list(range(chunk.first_row, chunk.first_row + len(chunk.texts)))


class _Scan:
    """Reads the input part by part; parts already committed are counted and skipped."""

    def __init__(self, job: EmbedJob, store: PartStore, progress: _Progress) -> None:
        self.job, self.store, self.progress = job, store, progress
        self.num_rows = self.num_parts = self.num_skipped = 0

    def pending(self) -> Iterator[Chunk]:
        for chunk in read_chunks(self.job.source, self.job.rows_per_part):
            index = chunk.first_row // self.job.rows_per_part
            self.num_rows = chunk.first_row + len(chunk.texts)
            self.num_parts += 1
            if self.store.is_done(index, chunk.first_row, len(chunk.texts)):
                self.num_skipped += 1
                self.progress.skip(len(chunk.texts))
                continue
            yield chunk


class _Progress:
    """rows (with ETA when the total is known) and tokens/s of this run."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.bar = tqdm(total=total, unit="rows", desc="Embedding", disable=not enabled)
        self.started = time.monotonic()
        self.num_tokens = 0

    def skip(self, num_rows: int) -> None:
        if self.bar.total is not None:
            self.bar.total -= num_rows
        self.bar.set_description("Embedding (resumed)")
        self.started = time.monotonic()

    def update(self, num_rows: int, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        elapsed = max(time.monotonic() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.num_tokens / elapsed:,.0f} tokens/s", refresh=False)
        self.bar.update(num_rows)

    def close(self) -> None:
        self.bar.close()
