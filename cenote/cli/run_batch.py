"""``cenote run-batch -i IN.jsonl -o OUT.jsonl [MODEL]``: an OpenAI batch file through the
offline engine. A file in which two lines share a custom_id is refused before anything runs
(as OpenAI refuses it at upload). Lines are read, run and written a chunk at a time, in input
order; a bad line (not JSON, nested too deeply, too long, an invalid body) gets an error object
on its own output line and the others run as usual. The output appears complete or not at all
(written to a temporary file, then renamed). A line and each of its texts are bounded as the
server bounds a request body and its texts, before anything is tokenized."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from cenote.server.batch_lines import (
    LineError,
    custom_id_of,
    error_line,
    error_of,
    parse_line,
    success_line,
)
from cenote.server.batch_reader import RawLine, check_custom_ids, read_chunks
from cenote.server.state import ServerOptions

if TYPE_CHECKING:
    from cenote.apps.batch.handlers import BatchHandlers, GenerationTask, PoolingTask, Task
    from cenote.llm import LLM

    _GroupTask = TypeVar("_GroupTask", PoolingTask, GenerationTask)
    _AnyTask = TypeVar("_AnyTask", bound=Task)


_CHUNK_BYTES = 64 << 20  # input held at a time, whatever --lines-per-chunk says


@dataclass(frozen=True)
class BatchLimits:
    """What one line may hold; the defaults are ``cenote serve``'s for one request."""

    max_line_bytes: int = ServerOptions.max_body_bytes  # longer: that line's error (413)
    max_input_chars: int = ServerOptions.max_input_chars  # a longer text: its line's error (400)


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
    parser.add_argument(
        "--max-line-bytes", type=int, default=BatchLimits.max_line_bytes,
        help="bytes in one line (more: that line's error, 413)",
    )  # fmt: skip
    parser.add_argument(
        "--max-input-chars", type=int, default=BatchLimits.max_input_chars,
        help="characters in one input text (more: its line's error, 400)",
    )  # fmt: skip
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from cenote.engine_args import EngineArgs
    from cenote.llm import LLM

    if not args.input_file.is_file():
        raise FileNotFoundError(f"cannot read the batch file {args.input_file}: no such file")
    limits = BatchLimits(args.max_line_bytes, args.max_input_chars)
    check_custom_ids(args.input_file, limits.max_line_bytes)  # before the model loads
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(engine_args.model, **engine_args.as_options())
    summary = _run_lines(llm, args.input_file, args.output_file, args.lines_per_chunk, limits)
    print(
        f"cenote run-batch: {summary.num_lines} lines, {summary.num_failed} failed -> "
        f"{args.output_file}"
    )
    return 0


def run_batch(
    llm: LLM,
    input_path: Path,
    output_path: Path,
    lines_per_chunk: int = 512,
    limits: BatchLimits | None = None,
) -> BatchSummary:
    """Run every line of ``input_path``; write one result line per input line, in order
    (``BatchFileError``, and no output, if two lines share a custom_id)."""
    limits = limits or BatchLimits()
    check_custom_ids(input_path, limits.max_line_bytes)
    return _run_lines(llm, input_path, output_path, lines_per_chunk, limits)


def _run_lines(
    llm: LLM, input_path: Path, output_path: Path, lines_per_chunk: int, limits: BatchLimits
) -> BatchSummary:
    from cenote.apps.batch.handlers import BatchHandlers

    handlers = BatchHandlers(llm, limits.max_input_chars)
    encoder = msgspec.json.Encoder()
    tmp = output_path.with_name(f".{output_path.name}.tmp")
    chunks = read_chunks(input_path, limits.max_line_bytes, lines_per_chunk, _CHUNK_BYTES)
    num_lines = num_failed = 0
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                for result in _run_chunk(handlers, chunk, limits):
                    num_failed += result["error"] is not None
                    num_lines += 1
                    out.write(encoder.encode(result) + b"\n")
        os.replace(tmp, output_path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # complete or not at all
        raise
    return BatchSummary(num_lines, num_failed)


def _run_chunk(
    handlers: BatchHandlers, chunk: list[RawLine], limits: BatchLimits
) -> list[dict[str, Any]]:
    """1) parse and prepare each line alone, 2) run by kind, 3) results in input order."""
    from cenote.apps.batch.handlers import GenerationTask, PoolingTask, ScoringTask

    results: dict[int, dict[str, Any]] = {}
    tasks: list[Task] = []
    for raw in chunk:
        number = raw.number
        if raw.too_long:
            results[number] = error_line(None, _too_long(raw, limits.max_line_bytes))
            continue
        try:
            line = parse_line(number, raw.data)
            tasks.append(handlers.prepare(line))
        except Exception as e:
            results[number] = error_line(custom_id_of(raw.data), error_of(number, e))
    pooling = [t for t in tasks if isinstance(t, PoolingTask)]
    results.update(_run_group(pooling, handlers.run_pooling))
    generation = [t for t in tasks if isinstance(t, GenerationTask)]
    results.update(_run_group(generation, handlers.run_generation))
    for task in tasks:
        if isinstance(task, ScoringTask):
            results[task.line.number] = _result(task, handlers.run_scoring)
    return [results[raw.number] for raw in chunk]


def _too_long(raw: RawLine, limit: int) -> LineError:
    return LineError(
        f"line {raw.number} has {raw.num_bytes} bytes, more than the limit of {limit} "
        "(--max-line-bytes)",
        status=413,
    )


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
