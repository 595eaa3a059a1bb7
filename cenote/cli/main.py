"""``cenote serve [MODEL] ...``: the OpenAI-compatible server (also ``python -m cenote serve``);
several models with ``--model NAME=PATH`` or ``--config`` (cli/model_specs.py), and
models loaded on demand with ``--models-dir`` (server/on_demand.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import fields
from typing import TYPE_CHECKING

import uvicorn

from cenote.cli import embed, run_batch
from cenote.cli.model_specs import ModelSpec, model_specs, models_dir_entries
from cenote.engine.cpu_shares import CoreShare, apply_share, share_cpus_and_slots
from cenote.engine_args import EngineArgs, HelpFormatter, add_arguments
from cenote.server.state import ServerOptions

if TYPE_CHECKING:
    from cenote.config import EngineConfig
    from cenote.server.served_models import ServedModels

logger = logging.getLogger("cenote.serve")


def _parser() -> argparse.ArgumentParser:
    from cenote import __version__

    parser = argparse.ArgumentParser(prog="cenote")
    parser.add_argument("--version", action="version", version=f"cenote {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve MODEL over an OpenAI-compatible HTTP API. The engine options are "
        "LLM(model, **options)'s; the server options bound what a request may do.",
        formatter_class=HelpFormatter,
    )
    EngineArgs.add_cli_args(serve)
    models = serve.add_argument_group("several models (one engine core each, one front door)")
    models.add_argument(
        "--model", dest="models", action="append", metavar="NAME=PATH",
        help="serve PATH as NAME (repeat for each model; a request that names none goes to the "
        "first that serves its task); a bare PATH is the positional MODEL (default: the positional "
        "MODEL alone)",
    )  # fmt: skip
    models.add_argument(
        "--config", metavar="FILE",
        help='a JSON file {"models": {"NAME": {"model": PATH, "dtype": ..., '
        '"max_model_len": ..., "data_parallel_size": ...}}}: per-model engine options (every '
        "engine option, data_parallel_size, chat_template) over the command line's (default: none)",
    )  # fmt: skip
    add_arguments(serve.add_argument_group("server options"), ServerOptions)
    run_batch.add_parser(commands)
    embed.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        sys.exit(_run_job(parser, args))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        _check_port(args.host, args.port)  # before loading a model: fail fast
        code = serve(args)
    except (FileNotFoundError, ValueError) as e:  # a bad model path or option: no traceback
        parser.exit(2, f"cenote serve: error: {e}\n")
    sys.exit(code)


def _run_job(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """run-batch / embed: bad input (file, line, field, address) exits 1 with the reason."""
    try:
        code: int = args.run(args)
        return code
    except (FileNotFoundError, ValueError, ConnectionError) as e:
        parser.exit(1, f"cenote {args.command}: error: {e}\n")


def _check_port(host: str, port: int) -> None:
    """Refuse a port that cannot be served (out of range, in use, not allowed) at once."""
    if not 0 < port < 65536:
        raise ValueError(f"--port must be between 1 and 65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from e


def serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT (exit 0 after draining) or until the engine dies (exit 1)."""
    # The front process only does HTTP, JSON and tokenization: keep it off the compute cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch

    torch.set_num_threads(1)
    from cenote.server.app import build_app
    from cenote.server.http import ConnectionLimits, connection_protocol

    given = {f.name: getattr(args, f.name) for f in fields(ServerOptions) if hasattr(args, f.name)}
    options = ServerOptions(
        **{**given, "api_key": _api_key(args.api_key),
           "chat_template": _chat_template(args.chat_template)}
    )  # fmt: skip
    protocol = connection_protocol(ConnectionLimits(
        read_timeout_s=options.read_timeout, first_byte_timeout_s=options.first_byte_timeout,
        max_connections=options.max_connections,
        max_connections_per_client=options.max_connections_per_client,
    ))  # fmt: skip
    tracer = None  # before any model loads: a missing extra fails at once
    if options.otlp_traces_endpoint is not None:
        from cenote.server.tracing import RequestTracer

        tracer = RequestTracer.to_endpoint(options.otlp_traces_endpoint)
    if options.batch_dir is not None:  # batch lines (BATCH_PRIORITY) go after interactive ones
        args.scheduling_policy = "priority"
        logger.info("Batch API on (%s): engines schedule by priority", options.batch_dir)
    served = _served_models(model_specs(args), options, EngineArgs.from_cli_args(args))
    config = uvicorn.Config(
        build_app(served, tracer), host=options.host, port=options.port, log_level=options.log_level,
        access_log=False, timeout_graceful_shutdown=None, http=protocol,
        # uvicorn annotates an int, but the value is a loop delay: seconds as a float work
        timeout_keep_alive=options.keep_alive_timeout,  # type: ignore[arg-type]
    )  # fmt: skip
    server = _Server(config)
    exit_code = 0

    def on_engine_dead(reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        delay = options.engine_dead_exit_delay_s
        logger.error("engine core died (%s); exiting in %.1f s", reason, delay)
        asyncio.get_running_loop().call_later(delay, setattr, server, "should_exit", True)

    served.on_all_dead = on_engine_dead
    server.run()
    if served.any_dead:
        exit_code = 1
    return exit_code


def _served_models(
    specs: list[ModelSpec], options: ServerOptions, base: EngineArgs | None = None
) -> ServedModels:
    """Each model's engine config (with its CPU share when there are several: engine/
    cpu_shares.py) and state; a model that cannot be read is an error naming it. The models
    of ``--models-dir`` take ``base``'s engine options (the command line's; default: the
    defaults) and are read when they load."""
    from cenote.server.metrics import MetricFamilies
    from cenote.server.on_demand import LoadPolicy, OnDemandModels
    from cenote.server.served_models import ServedModels
    from cenote.server.state import ServerState

    configs, model_options = [], []
    for spec in specs:
        try:
            configs.append(spec.engine_args.create_engine_config())
        except (FileNotFoundError, ValueError) as e:
            if len(specs) == 1:
                raise
            raise ValueError(f"model {spec.name or spec.engine_args.model!r}: {e}") from e
        template = spec.options.get("chat_template")
        model_options.append(dataclasses.replace(
            options,
            chat_template=options.chat_template if template is None else _chat_template(template),
            data_parallel_size=spec.options.get("data_parallel_size", options.data_parallel_size),
        ))  # fmt: skip
    dir_models = _models_dir(options, configs, specs)
    num_slots = min(options.max_loaded_models or len(dir_models), len(dir_models))
    slot_shares: list[CoreShare | None] = [None] * num_slots
    if len(specs) + len(dir_models) > 1 and options.distributed_executor == "process":
        sizes = [o.data_parallel_size for o in model_options]
        configs, slot_shares = share_cpus_and_slots(
            configs, sizes, sorted(os.sched_getaffinity(0)), num_slots,
            options.data_parallel_size,
        )  # fmt: skip
    families = MetricFamilies()
    states = [
        ServerState(config, model_option, families)
        for config, model_option in zip(configs, model_options, strict=True)
    ]
    if not dir_models:
        return ServedModels(states, options, families)

    def make_state(name: str, path: str, slot: int) -> ServerState:
        engine_args = base if base is not None else EngineArgs()
        config = dataclasses.replace(engine_args, model=path, served_model_name=name)
        return ServerState(
            apply_share(config.create_engine_config(), slot_shares[slot]), options, families
        )

    policy = LoadPolicy(
        options.max_loaded_models, options.idle_unload_seconds, options.model_load_timeout
    )
    return ServedModels(states, options, families, OnDemandModels(dir_models, policy, make_state))


def _models_dir(
    options: ServerOptions, configs: list[EngineConfig], specs: list[ModelSpec]
) -> list[tuple[str, str]]:
    """The models of ``--models-dir`` (none without it); a name also served by ``--model`` /
    ``--config`` is an error naming both, as are bounds that cannot hold."""
    if options.models_dir is None:
        for flag, value in [("--max-loaded-models", options.max_loaded_models),
                            ("--idle-unload-seconds", options.idle_unload_seconds)]:  # fmt: skip
            if value is not None:
                raise ValueError(f"{flag} bounds the models of --models-dir; give --models-dir")
        return []
    if options.max_loaded_models is not None and options.max_loaded_models < 1:
        raise ValueError(f"--max-loaded-models must be >= 1, got {options.max_loaded_models}")
    if options.idle_unload_seconds is not None and not options.idle_unload_seconds > 0:
        raise ValueError(f"--idle-unload-seconds must be > 0, got {options.idle_unload_seconds}")
    if not options.model_load_timeout > 0:
        raise ValueError(f"--model-load-timeout must be > 0, got {options.model_load_timeout}")
    entries = models_dir_entries(options.models_dir)
    served: dict[str, str] = {}  # name -> where it comes from
    for config, spec in zip(configs, specs, strict=True):
        origin = f"--model / --config ({spec.engine_args.model})"
        served[config.model.served_model_name] = origin
        served.update({m.lora_name: f"a LoRA adapter of {origin}" for m in config.lora.modules})
    for name, path in entries:
        if name in served:
            raise ValueError(
                f"the model name {name!r} is served twice: by {served[name]} and by {path} "
                "in --models-dir; rename one"
            )
    return entries


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text when ``value`` names a file, else the template itself
    (as vLLM reads it)."""
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as file:
        return file.read()


def _api_key(value: str | None) -> str | None:
    """``--api-key``, else ``CENOTE_API_KEY`` (kept out of ``--help`` and the process list)."""
    if value is None:
        value = os.environ.get("CENOTE_API_KEY")
    return value or None


class _Server(uvicorn.Server):
    """uvicorn, except a handled SIGTERM/SIGINT ends in a normal exit (code 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


if __name__ == "__main__":
    main()
