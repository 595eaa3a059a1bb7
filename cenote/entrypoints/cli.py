"""``cenote serve [MODEL] ...``: the OpenAI-compatible server (also ``python -m cenote serve``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn

from cenote.entrypoints import embed, run_batch
from cenote.server.state import ServerOptions

logger = logging.getLogger("cenote.serve")


def _parser() -> argparse.ArgumentParser:
    from cenote import __version__

    parser = argparse.ArgumentParser(prog="cenote")
    parser.add_argument("--version", action="version", version=f"cenote {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    defaults = ServerOptions()
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model folder or .gguf file (default: the embedded all-MiniLM-L6-v2)",
    )
    serve.add_argument("--host", default=defaults.host)
    serve.add_argument("--port", type=int, default=defaults.port)
    serve.add_argument("--api-key", default=os.environ.get("CENOTE_API_KEY"))
    serve.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    serve.add_argument("--max-num-batched-tokens", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--num-threads", type=int, default=None, help="engine torch threads")
    serve.add_argument("--hf-overrides", type=json.loads, default=None, help="JSON object")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--pooler-config", type=json.loads, default=None,
        help='JSON, e.g. {"pooling_type": "MEAN", "normalize": false}',
    )  # fmt: skip
    serve.add_argument(
        "--chat-template", default=None,
        help="a Jinja chat template, or the file holding one (default: the model's own)",
    )  # fmt: skip
    serve.add_argument(
        "--max-logprobs", type=int, default=20,
        help="most top logprobs (logprobs / top_logprobs / prompt_logprobs) a request may ask for",
    )  # fmt: skip
    serve.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    serve.add_argument(
        "--convert", default="auto", choices=["auto", "embed", "classify"],
        help="serve a causal LM as an embedding model or a classifier",
    )  # fmt: skip
    serve.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    serve.add_argument("--max-inputs", type=int, default=defaults.max_inputs)
    serve.add_argument("--max-input-chars", type=int, default=defaults.max_input_chars)
    serve.add_argument(
        "--max-waiting-requests", type=int, default=defaults.max_waiting_requests,
        help="requests queued beyond --max-num-seqs before answering 429",
    )  # fmt: skip
    serve.add_argument(
        "--read-timeout", type=float, default=30.0,
        help="seconds a client has to send a whole request (headers and body); slower: closed",
    )  # fmt: skip
    serve.add_argument(
        "--keep-alive-timeout", type=float, default=5.0,
        help="seconds an idle keep-alive connection is kept open",
    )  # fmt: skip
    serve.add_argument(
        "--max-connections", type=int, default=1024,
        help="open connections (and their requests) at once; more are answered 503",
    )  # fmt: skip
    serve.add_argument(
        "--data-parallel-size", type=int, default=defaults.data_parallel_size,
        help="engine-core processes, each on its own share of the cores; requests go to the "
        "least loaded (generation: the one holding the prompt's prefix)",
    )  # fmt: skip
    serve.add_argument(
        "--distributed-executor", default="process", choices=["process", "ray"],
        help="engine cores as local processes, or as Ray actors on a cluster (zmq over TCP)",
    )  # fmt: skip
    serve.add_argument(
        "--ray-address", default=None,
        help="the Ray cluster for --distributed-executor ray (default: RAY_ADDRESS or local)",
    )  # fmt: skip
    serve.add_argument(
        "--engine-heartbeat-timeout", type=float, default=defaults.engine_heartbeat_timeout_s,
        help="seconds without a word from the engine core before /health reports it hung",
    )  # fmt: skip
    serve.add_argument(
        "--max-request-tokens", type=int, default=defaults.max_request_tokens,
        help="prompt tokens of one request, all its inputs together (more: 400)",
    )  # fmt: skip
    serve.add_argument(
        "--max-response-values", type=int, default=defaults.max_response_values,
        help="numbers in one pooling response, e.g. token_embed tokens x size (more: 400)",
    )  # fmt: skip
    serve.add_argument(
        "--auto-truncate", action="store_true",
        help="embedding routes cut inputs longer than the model's limit instead of refusing them",
    )  # fmt: skip
    serve.add_argument("--log-level", default="info")
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
        return args.run(args)
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
    from cenote.server.http import with_read_timeout
    from cenote.server.state import ServerState

    options = ServerOptions(
        host=args.host, port=args.port, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        max_inputs=args.max_inputs, max_input_chars=args.max_input_chars,
        max_waiting_requests=args.max_waiting_requests, auto_truncate=args.auto_truncate,
        max_request_tokens=args.max_request_tokens, max_response_values=args.max_response_values,
        engine_heartbeat_timeout_s=args.engine_heartbeat_timeout,
        distributed_executor=args.distributed_executor, ray_address=args.ray_address,
        data_parallel_size=args.data_parallel_size, chat_template=_chat_template(args.chat_template),
    )  # fmt: skip
    state = ServerState(_engine_config(args), options)
    config = uvicorn.Config(
        build_app(state), host=args.host, port=args.port, log_level=args.log_level,
        access_log=False, timeout_graceful_shutdown=None,
        http=with_read_timeout(args.read_timeout), timeout_keep_alive=args.keep_alive_timeout,
        limit_concurrency=args.max_connections,
    )  # fmt: skip
    server = _Server(config)
    exit_code = 0

    def on_engine_dead(reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        delay = options.engine_dead_exit_delay_s
        logger.error("engine core died (%s); exiting in %.1f s", reason, delay)
        asyncio.get_running_loop().call_later(delay, setattr, server, "should_exit", True)

    state.on_engine_dead = on_engine_dead
    server.run()
    if state.client.dead_reason is not None:
        exit_code = 1
    return exit_code


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text when ``value`` names a file, else the template itself
    (as vLLM reads it)."""
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as file:
        return file.read()


def _engine_config(args: argparse.Namespace):
    from cenote.config import build_engine_config

    return build_engine_config(
        args.model,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        hf_overrides=args.hf_overrides,
        num_threads=args.num_threads,
        scheduling_policy=args.scheduling_policy,
        served_model_name=args.served_model_name,
        seed=args.seed,
        convert=args.convert,
        pooler_config=args.pooler_config,
        max_logprobs=args.max_logprobs,
    )


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
