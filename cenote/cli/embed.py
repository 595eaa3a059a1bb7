"""``cenote embed INPUT -o OUTPUT``: embed a corpus (JSONL, CSV, Parquet or text) into Parquet
part files (or one .npy + ids), resumably; ``--ray [ADDRESS]`` runs it on a Ray cluster."""

from __future__ import annotations

import argparse
from pathlib import Path

from cenote.apps.corpus.readers import INPUT_FORMATS


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from cenote.engine_args import EngineArgs, HelpFormatter

    parser = commands.add_parser(
        "embed",
        formatter_class=HelpFormatter,
        help="embed a corpus into Parquet parts (or .npy), resumably",
        description="Embed every passage of INPUT. OUTPUT is a directory of Parquet part files "
        "(id, embedding, num_tokens) or a .npy file (embeddings; ids in <stem>.ids.parquet). "
        "Rerun the same command after an interruption to resume.",
    )
    parser.add_argument("input", type=Path, help="JSONL, CSV, Parquet or text (one passage a line)")
    parser.add_argument("-o", "--output", required=True, type=Path)
    parser.add_argument(
        "--model", default=None,
        help="model folder, .gguf file or hub id in the local Hugging Face cache (as cenote "
        "serve's MODEL); default: the embedded all-MiniLM-L6-v2",
    )  # fmt: skip
    parser.add_argument("--input-format", choices=INPUT_FORMATS, default=None)
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--id-field", default=None, help="default: ids are 0-based row numbers")
    parser.add_argument(
        "--truncate", nargs="?", type=int, const=-1, default=None, metavar="N",
        help="cut passages to N tokens (no N: the model's limit); without it a too-long "
        "passage is an error",
    )  # fmt: skip
    parser.add_argument("--dimensions", type=int, default=None, help="matryoshka truncation")
    parser.add_argument("--rows-per-part", type=int, default=1024)
    parser.add_argument(
        "--max-tokens-per-batch", type=int, default=None,
        help="the engine's token budget per step (default: max(8192, max_model_len))",
    )  # fmt: skip
    EngineArgs.add_cli_args(parser, include=("revision", "dtype", "num_threads"))
    parser.add_argument("--no-progress", action="store_true")
    ray = parser.add_argument_group("Ray (pip install 'cenote[ray]')")
    ray.add_argument(
        "--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
        help="run on the Ray cluster at ADDRESS (host:port, ray://host:port or auto); "
        "no ADDRESS: a local Ray instance",
    )  # fmt: skip
    ray.add_argument(
        "--ray-workers", type=int, default=None,
        help="engines (actors); default: as many as the cluster's CPUs allow",
    )  # fmt: skip
    ray.add_argument(
        "--ray-cpus-per-worker", type=int, default=1, help="CPUs (torch threads) per engine"
    )
    ray.add_argument(
        "--ray-batch-size", type=int, default=None, help="rows per map_batches call (a part)"
    )
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from cenote.apps.corpus.job import EmbedJob, run_embed_job
    from cenote.apps.corpus.readers import open_source

    source = open_source(args.input, args.text_field, args.id_field, args.input_format)
    job = EmbedJob(
        source=source, output=args.output, model=args.model, revision=args.revision,
        dtype=args.dtype, truncate=args.truncate, dimensions=args.dimensions,
        rows_per_part=args.rows_per_part, max_tokens_per_batch=args.max_tokens_per_batch,
        num_threads=args.num_threads, progress=not args.no_progress,
    )  # fmt: skip
    embed_parts = None
    if args.ray is not None:
        from cenote.apps.corpus.ray_parts import RayEmbedParts, RayOptions

        options = RayOptions(
            address=None if args.ray == "local" else args.ray, num_workers=args.ray_workers,
            cpus_per_worker=args.ray_cpus_per_worker, batch_size=args.ray_batch_size,
        )  # fmt: skip
        embed_parts = RayEmbedParts(job, options)
    summary = run_embed_job(job, embed_parts)
    rate = summary.num_tokens / max(summary.seconds, 1e-9)
    print(
        f"cenote embed: {summary.num_rows} rows in {summary.num_parts} parts "
        f"({summary.num_parts_skipped} done earlier), {summary.num_tokens} tokens in "
        f"{summary.seconds:.1f} s ({rate:,.0f} tokens/s) -> {summary.output}"
    )
    return 0
