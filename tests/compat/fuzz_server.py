"""Fuzz every route of ``cenote serve`` over its own OpenAPI schema (schemathesis).

    python -m tests.compat.fuzz_server [--requests 5000] [--model default|smollm2|both] [--seed 0]

Starts the server on the default model (all-MiniLM-L6-v2) and / or the SmolLM2 GGUF, records a
fixed set of answers, sends seeded rounds of positive and negative cases for every operation
until ``--requests`` (split evenly between the models) are sent, then checks the server is
healthy and answers the fixed set as before. Prints per model a table of requests and statuses
per route, 5xx and schema violations (each with a curl line to reproduce it); exits 1 if there
was any 5xx, violation or changed answer.
"""

from __future__ import annotations

import argparse
import sys

from tests.compat.schema_fuzz import (
    EMBEDDING_PROBES,
    GENERATION_PROBES,
    FuzzReport,
    answers,
    fuzz,
    load_schema,
)
from tests.server_fixture import ServerProcess


def server_args(model: str, num_threads: int) -> list[str]:
    args = ["--dtype", "float32", "--num-threads", str(num_threads)]
    if model == "smollm2":
        from tests.factories.smollm2 import find_smollm2_gguf

        return [str(find_smollm2_gguf()), *args]
    return args


def fuzz_model(model: str, num_requests: int, seed: int, examples: int, threads: int) -> bool:
    """Fuzz one model's server; prints its table; True when it passed."""
    probes = GENERATION_PROBES if model == "smollm2" else EMBEDDING_PROBES
    server = ServerProcess(*server_args(model, threads))
    try:
        before = answers(server.url, probes)
        schema = load_schema(server.url)
        report, round_ = FuzzReport(), 0
        while report.num_requests < num_requests:
            report.merge(fuzz(server.url, examples, seed=seed + round_, schema=schema))
            round_ += 1
            print(f"  {model}: round {round_}, {report.num_requests} requests", file=sys.stderr)
        after = answers(server.url, probes)
    finally:
        server.stop()
    print(report.table(f"\n== {model} ({round_} rounds of {examples} examples per operation "
                       f"and mode, seeds {seed}..{seed + round_ - 1})"))  # fmt: skip
    for violation in report.violations:
        print(f"\n{violation.route} -> {violation.status}: {violation.message}\n{violation.curl}")
    changed = [p for p, b, a in zip(probes, before, after, strict=True) if b != a]
    print(f"fixed answers unchanged after fuzzing: {len(probes) - len(changed)}/{len(probes)}")
    for method, path, body in changed:
        print(f"  CHANGED: {method} {path} {body}")
    return not (report.violations or report.num_server_errors or changed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000, help="total, across the models")
    parser.add_argument("--model", choices=["default", "smollm2", "both"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--examples", type=int, default=25, help="per operation, mode, round")
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    models = ["default", "smollm2"] if args.model == "both" else [args.model]
    share = -(-args.requests // len(models))
    results = [fuzz_model(m, share, args.seed, args.examples, args.num_threads) for m in models]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
