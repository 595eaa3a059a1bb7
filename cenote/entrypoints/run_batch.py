"""``cenote run-batch -i IN.jsonl -o OUT.jsonl [MODEL]``: an OpenAI batch file through the
offline engine. Lines are read, run and written a chunk at a time, in input order; a bad line
gets an error object on its own output line and the others run as usual. The output appears
complete or not at all (written to a temporary file, then renamed)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from cenote.batch.lines import custom_id_of, error_line, error_of, parse_line, success_line

if TYPE_CHECKING:
    from cenote.batch.handlers import BatchHandlers, GenerationTask, PoolingTask, Task
    from cenote.entrypoints.llm import LLM

    _GroupTask = TypeVar("_GroupTask", PoolingTask, GenerationTask)
    _AnyTask = TypeVar("_AnyTask", bound=Task)


@dataclass
class BatchSummary:
    num_lines: int
    num_failed: int


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from cenote.engine_args import EngineArgs, HelpFormatter

    parser = commands.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSONL) through the offline engine",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-i", "--input-file", required=True, type=Path, help="the batch (JSONL)")
    parser.add_argument(
        "-o", "--output-file", required=True, type=Path, help="one result line per input line"
    )
    parser.add_argument(
        "--lines-per-chunk", type=int, default=512, help="lines read and run at a time"
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from cenote.engine_args import EngineArgs
    from cenote.entrypoints.llm import LLM

    if not args.input_file.is_file():
        raise FileNotFoundError(f"cannot read the batch file {args.input_file}: no such file")
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(engine_args.model, **engine_args.as_options())
    summary = run_batch(llm, args.input_file, args.output_file, args.lines_per_chunk)
    print(
        f"cenote run-batch: {summary.num_lines} lines, {summary.num_failed} failed -> "
        f"{args.output_file}"
    )
    return 0


def run_batch(
    llm: LLM, input_path: Path, output_path: Path, lines_per_chunk: int = 512
) -> BatchSummary:
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


def _run_chunk(handlers: BatchHandlers, chunk: list[tuple[int, bytes]]) -> list[dict[str, Any]]:
    """1) parse and prepare each line alone, 2) run by kind, 3) results in input order."""
    from cenote.batch.handlers import GenerationTask, PoolingTask, ScoringTask

    results: dict[int, dict[str, Any]] = {}
    tasks: list[Task] = []
    for number, raw in chunk:
        try:
            line = parse_line(number, raw)
            tasks.append(handlers.prepare(line))
        except Exception as e:
            results[number] = error_line(custom_id_of(raw), error_of(number, e))
    pooling = [t for t in tasks if isinstance(t, PoolingTask)]
    results.update(_run_group(pooling, handlers.run_pooling))
    generation = [t for t in tasks if isinstance(t, GenerationTask)]
    results.update(_run_group(generation, handlers.run_generation))
    for task in tasks:
        if isinstance(task, ScoringTask):
            results[task.line.number] = _result(task, handlers.run_scoring)
    return [results[number] for number, _ in chunk]


def _run_group(
    group: list[_GroupTask], run: Callable[[list[_GroupTask]], list[dict[str, Any]]]
) -> dict[int, dict[str, Any]]:
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


def _result(task: _AnyTask, run_one: Callable[[_AnyTask], dict[str, Any]]) -> dict[str, Any]:
    """The line of ``task``: its body from ``run_one(task)``, or the error it raised."""
    try:
        return success_line(task.line.custom_id, run_one(task))
    except Exception as e:
        return error_line(task.line.custom_id, error_of(task.line.number, e))
