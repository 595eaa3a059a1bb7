"""Corpus jobs: a deterministic corpus, the job on the session's engine, and
reading a job's output back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from cenote.apps.corpus.job import EmbedJob, LocalEmbedParts, run_embed_job

LONG_TEXT = "word " * 400  # more than all-MiniLM-L6-v2's 256 tokens


def corpus(num_rows: int) -> list[dict]:
    return [
        {"doc": f"d{i}", "body": f"passage {i} on topic {i % 7}" + " more" * (i % 23)}
        for i in range(num_rows)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_output(path: Path) -> tuple[list, np.ndarray, list[int]]:
    table = pq.read_table(path)
    embeddings = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    return table.column("id").to_pylist(), embeddings, table.column("num_tokens").to_pylist()


class SharedEngine(LocalEmbedParts):
    """The job's local path on the session's fp32 engine (no second model load)."""

    def __init__(self, job: EmbedJob, llm) -> None:
        self.job, self.llm = job, llm


def embed_job(llm, source, output: Path, **options) -> EmbedJob:
    job = EmbedJob(source=source, output=output, progress=False, **options)
    run_embed_job(job, SharedEngine(job, llm))
    return job
