"""``cenote run-batch -i IN.jsonl -o OUT.jsonl [MODEL]``: an OpenAI batch file through the
offline engine. Lines are read, run and written a chunk at a time, in input order; a bad line
gets an error object on its own output line and the others run as usual. The output appears
complete or not at all (written to a temporary file, then renamed)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from cenote.batch.lines import custom_id_of, error_line, error_of, parse_line, success_line


@dataclass
class BatchSummary:
    num_lines: int
    num_failed: int


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) through the offline engine"
    )
    parser.add_argument("model", nargs="?", default=None, help="model folder or .gguf file")
    parser.add_argument("-i", "--input-file", required=True, type=Path)
    parser.add_argument("-o", "--output-file", required=True, type=Path)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--convert", default="auto", choices=["auto", "embed", "classify"])
    parser.add_argument("--lines-per-chunk", type=int, default=512)
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from cenote.entrypoints.llm import LLM

    if not args.input_file.is_file():
        raise FileNotFoundError(f"cannot read the batch file {args.input_file}: no such file")
    llm = LLM(
        args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, num_threads=args.num_threads,
        served_model_name=args.served_model_name, convert=args.convert,
    )  # fmt: skip
    summary = run_batch(llm, args.input_file, args.output_file, args.lines_per_chunk)
    print(
        f"cenote run-batch: {summary.num_lines} lines, {summary.num_failed} failed -> "
        f"{args.output_file}"
    )
    return 0


def run_batch(llm, input_path: Path, output_path: Path, lines_per_chunk: int = 512) -> BatchSummary:
    """Run every line of ``input_path``; write one result line per input line, in order."""
    from cenote.batch.handlers import BatchHandlers

    handlers = BatchHandlers(llm)
    encoder = msgspec.json.Encoder()
    tmp = output_path.with_name(f".{output_path.name}.tmp")
    num_lines = num_failed = 0
    with open(tmp, "wb") as out:
        for chunk in _chunks(input_path, lines_per_chunk):
            for result in _run_chunk(handlers, chunk):
                num_failed += result["error"] is not None
                num_lines += 1
                out.write(encoder.encode(result) + b"\n")
    os.replace(tmp, output_path)
    return BatchSummary(num_lines, num_failed)


def _chunks(path: Path, size: int) -> Iterator[list[tuple[int, bytes]]]:
    """(1-based line number, line) a chunk at a time."""
    chunk: list[tuple[int, bytes]] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            chunk.append((number, raw))
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _run_chunk(handlers, chunk: list[tuple[int, bytes]]) -> list[dict[str, Any]]:
    """1) parse and prepare each line alone, 2) run by kind, 3) results in input order."""
    from cenote.batch.handlers import GenerationTask, PoolingTask, ScoringTask

    results: dict[int, dict[str, Any]] = {}
    tasks = []
    for number, raw in chunk:
        try:
            line = parse_line(number, raw)
            tasks.append(handlers.prepare(line))
        except Exception as e:
            results[number] = error_line(custom_id_of(raw), error_of(number, e))
    groups = (
        ([t for t in tasks if isinstance(t, PoolingTask)], handlers.run_pooling),
        ([t for t in tasks if isinstance(t, GenerationTask)], handlers.run_generation),
    )
    for group, run in groups:
        results.update(_run_group(group, run))
    for task in tasks:
        if isinstance(task, ScoringTask):
            results[task.line.number] = _result(task, handlers.run_scoring)
    return [results[number] for number, _ in chunk]


def _run_group(group: list, run) -> dict[int, dict[str, Any]]:
    """One engine call for the group; if it fails, each line alone (so only the bad one fails)."""
    if not group:
        return {}
    try:
        bodies = run(group)
    except Exception:
        return {t.line.number: _result(t, lambda task: run([task])[0]) for t in group}
    return {
        t.line.number: success_line(t.line.custom_id, b) for t, b in zip(group, bodies, strict=True)
    }


def _result(task, run_one) -> dict[str, Any]:
    """The line of ``task``: its body from ``run_one(task)``, or the error it raised."""
    try:
        return success_line(task.line.custom_id, run_one(task))
    except Exception as e:
        return error_line(task.line.custom_id, error_of(task.line.number, e))
