"""EngineArgs: one option list for ``LLM(**options)``, ``cenote serve`` and ``cenote run-batch``;
start-up checks with the numbers; no process-global side effects from building an engine."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import pickle
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import NUM_THREADS
from factories.decoders import make_decoder
from factories.encoders import make_encoder
from factories.smollm2 import find_smollm2_gguf

from cenote import LLM, SamplingParams
from cenote.cli import main as cli
from cenote.engine.core_launcher import CORE_ENVIRONMENT, child_environment
from cenote.engine_args import EngineArgs
from cenote.models import gguf_loader
from cenote.models.tokenizer import load_chat_template, load_tokenizer
from cenote.server.state import ServerOptions

FIELDS = [f for f in dataclasses.fields(EngineArgs) if f.name != "model"]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli._parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def _option_help(parser: argparse.ArgumentParser, monkeypatch) -> dict[str, str]:
    """``--flag`` -> its help text, as ``--help`` prints it (wrapped lines joined)."""
    monkeypatch.setenv("COLUMNS", "2000")
    options: dict[str, str] = {}
    flag = None
    for line in parser.format_help().splitlines():
        # a metavar, repeated for a list option (``--x ENTRY [ENTRY ...]``)
        metavar = r"(?: \S+(?: \[\S+ \.\.\.\])?)?"
        start = re.match(rf"  (--?[\w-]+)(?:, --[\w-]+)?{metavar}(?:\s{{2,}}(.*))?$", line)
        if start:
            flag = start[1]
            options[flag] = start[2] or ""
        elif flag is not None and line.startswith("   "):
            options[flag] = f"{options[flag]} {line.strip()}".strip()
        else:
            flag = None
    return options


def _shown_default(f: dataclasses.Field) -> str:
    return f.metadata["shown"] or str(f.default)


# ---- one option list ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "run-batch"])
def test_every_engine_option_is_a_flag_with_help_and_default(command, monkeypatch) -> None:
    options = _option_help(_subparser(command), monkeypatch)
    for f in FIELDS:
        flag = f"--{f.name.replace('_', '-')}"
        assert flag in options, f"{f.name} has no {flag} in `cenote {command} --help`"
        text = options[flag]
        assert len(text) > len(f"(default: {_shown_default(f)})"), f"{flag} has no help text"
        assert text.endswith(f"(default: {_shown_default(f)})"), (flag, text)


def test_every_serve_option_shows_a_default(monkeypatch) -> None:
    options = _option_help(_subparser("serve"), monkeypatch)
    flags = [f for f in dataclasses.fields(ServerOptions) if "help" in f.metadata]
    for f in flags:
        flag = f"--{f.name.replace('_', '-')}"
        assert flag in options, f.name
        if f.type != "bool":  # bool flags: argparse adds the default
            assert options[flag].endswith(f"(default: {_shown_default(f)})"), (flag, options[flag])
    for flag, text in options.items():
        if flag != "-h":
            assert re.search(r"\w.*\(default: [^)]", text), f"{flag}: {text!r}"


def test_the_help_of_the_real_command_lists_the_new_engine_options() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cenote", "serve", "--help"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for flag in ("--block-size", "--no-enable-prefix-caching", "--kv-cache-memory-bytes"):
        assert flag in done.stdout


def test_every_engine_option_is_a_typed_keyword_of_llm() -> None:
    parameters = inspect.signature(LLM).parameters
    assert list(parameters) == ["model", *(f.name for f in FIELDS)]
    for f in FIELDS:
        parameter = parameters[f.name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert parameter.default == f.default and parameter.annotation, f.name


def test_command_line_values_reach_the_engine_args() -> None:
    parser = _subparser("serve")
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()
    args = parser.parse_args(
        [
            "some/model", "--block-size", "32", "--no-enable-prefix-caching",
            "--kv-cache-memory-bytes", "512MiB", "--hf-overrides", '{"is_matryoshka": true}',
            "--pooler-config", '{"pooling_type": "MEAN"}', "--dtype", "float32",
        ]
    )  # fmt: skip
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.model == "some/model" and engine_args.block_size == 32
    assert engine_args.enable_prefix_caching is False
    assert engine_args.kv_cache_memory_bytes == 512 << 20
    assert engine_args.hf_overrides == {"is_matryoshka": True}
    assert engine_args.pooler_config == {"pooling_type": "MEAN"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-cache-memory-bytes", "4XB"], "expected a size such as 4GiB or 512MiB"),
        (["--hf-overrides", "[1]"], "expected a JSON object"),
        (["--hf-overrides", "{"], "expected a JSON object"),
        (["--dtype", "float8"], "invalid choice: 'float8'"),
        (["--max-num-seqs", "many"], "invalid int value: 'many'"),
    ],
)
def test_bad_flag_values_exit_2_naming_the_flag(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _subparser("serve").parse_args(args)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert args[0] in error and message in error


def test_unknown_llm_option_is_a_type_error_listing_the_valid_ones() -> None:
    with pytest.raises(TypeError) as error:
        LLM(max_num_seq=8)  # no model is read: refused first
    message = str(error.value)
    assert "LLM() got an unknown option 'max_num_seq' (did you mean 'max_num_seqs'?)" in message
    assert "valid options: block_size, " in message
    assert all(f.name in message for f in FIELDS)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_num_seqs": "8"}, "option max_num_seqs must be int or None, got '8'"),
        ({"block_size": True}, "option block_size must be int, got True"),
        ({"scheduling_policy": "lifo"}, "must be one of 'fcfs', 'priority', got 'lifo'"),
        ({"dtype": "float8"}, "option dtype must be one of 'auto', 'float32'"),
        (
            {"quantized_dense_copy": "maybe"},
            "option quantized_dense_copy must be one of 'auto', 'on', 'off', got 'maybe'",
        ),
        ({"enable_prefix_caching": "no"}, "option enable_prefix_caching must be bool"),
        ({"hf_overrides": "[]"}, "option hf_overrides must be dict or None"),
    ],
)
def test_an_option_of_the_wrong_type_is_refused(options, message) -> None:
    with pytest.raises(TypeError, match=re.escape(message)):
        EngineArgs(**options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 0}, "block_size must be positive, got 0"),
        ({"num_threads": 0}, "num_threads must be positive, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs (0) must be positive"),
        ({"max_model_len": 0}, "max_model_len must be positive, got 0"),
        ({"max_model_len": 129}, "max_model_len 129 exceeds the model's limit 128"),
        ({"max_logprobs": -1}, "max_logprobs must be non-negative, got -1"),
    ],
)
def test_an_impossible_value_is_refused_with_the_number(tmp_path, options, message) -> None:
    make_encoder(tmp_path, "bert")  # max_position_embeddings 128
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(model=str(tmp_path), **options).create_engine_config()


# ---- impossible configurations fail at start-up ----------------------------------------------


def test_a_token_budget_below_an_encoders_length_fails_at_build(tmp_path: Path) -> None:
    """Encoder prompts are scheduled whole: a budget below max_model_len could never run the
    longest prompt. The scheduler still refuses such a request by itself (test_scheduler)."""
    make_encoder(tmp_path, "bert")
    with pytest.raises(ValueError) as error:
        LLM(str(tmp_path), max_num_batched_tokens=64)
    message = str(error.value)
    assert "max_num_batched_tokens (64) is below max_model_len (128)" in message
    assert "--max-num-batched-tokens) to at least 128" in message
    assert "--max-model-len) to at most 64" in message
    # what the message proposes works
    for options in ({"max_num_batched_tokens": 128}, {"max_num_batched_tokens": 64, "max_model_len": 64}):  # fmt: skip
        config = EngineArgs(model=str(tmp_path), **options).create_engine_config()
        assert config.scheduler.max_num_batched_tokens >= config.model.max_model_len


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama: max_model_len 256; fp32 KV blocks of 16 tokens are 8 KiB."""
    folder = tmp_path_factory.mktemp("llama")
    make_decoder(folder, "llama")
    return folder


@pytest.mark.parametrize(
    ("options", "phrases"),
    [
        (
            {"num_gpu_blocks_override": 10},
            ["the cache has 10 blocks (80.0 KiB, from num_gpu_blocks_override)",
             "raise num_gpu_blocks_override (--num-gpu-blocks-override) to at least 16"],
        ),
        (
            {"kv_cache_memory_bytes": 100_000},  # 12 blocks
            ["the cache has 12 blocks (96.0 KiB, from kv_cache_memory_bytes=100000)",
             "raise kv_cache_memory_bytes (--kv-cache-memory-bytes) to at least 131072 "
             "(128.0 KiB)"],
        ),
    ],
)  # fmt: skip
def test_a_kv_cache_below_one_longest_request_fails_at_start(decoder, options, phrases) -> None:
    """A request of max_model_len tokens would wait for KV blocks forever: refused up front."""
    with pytest.raises(ValueError) as error:
        LLM(str(decoder), dtype="float32", block_size=16, **options)
    message = str(error.value)
    assert "one request of the model's max_model_len (256 tokens)" in message
    assert "needs 16 blocks of 16 tokens (128.0 KiB)" in message
    for phrase in phrases:
        assert phrase in message
    longest = 16 * (10 if "num_gpu_blocks_override" in options else 12)
    assert f"or lower max_model_len (--max-model-len) to at most {longest}" in message
    # what the message proposes works, and the longest request then runs
    LLM(str(decoder), dtype="float32", block_size=16, num_gpu_blocks_override=16)
    llm = LLM(str(decoder), dtype="float32", block_size=16, max_model_len=longest, **options)
    params = SamplingParams(max_tokens=longest - 10, ignore_eos=True, temperature=0.0)
    (out,) = llm.generate([{"prompt_token_ids": [5] * 10}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == longest - 10


def _serve(*args: str) -> subprocess.CompletedProcess:
    from tests.server_fixture import free_port

    port = [] if "--port" in args else ["--port", str(free_port())]
    return subprocess.run(
        [sys.executable, "-m", "cenote", "serve", *args, *port],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip


def test_serve_refuses_an_impossible_token_budget_before_loading_the_model() -> None:
    done = _serve("--max-num-batched-tokens", "128")
    assert done.returncode == 2
    assert "max_num_batched_tokens (128) is below max_model_len (256)" in done.stderr
    assert "--max-num-batched-tokens" in done.stderr and "Traceback" not in done.stderr


def test_serve_refuses_a_kv_cache_below_one_longest_request(decoder) -> None:
    done = _serve(str(decoder), "--dtype", "float32", "--num-gpu-blocks-override", "4")
    assert done.returncode == 1
    assert "needs 16 blocks of 16 tokens" in done.stderr
    assert "--num-gpu-blocks-override) to at least 16" in done.stderr


def test_serve_checks_its_port_before_the_model() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _serve("/nonexistent/model", "--port", str(taken.getsockname()[1]))
    assert done.returncode == 2
    assert "Address already in use" in done.stderr and "not a model folder" not in done.stderr


# ---- no process-global side effects --------------------------------------------------------------


def test_llm_leaves_the_environment_and_thread_count_alone(tmp_path: Path) -> None:
    importlib.import_module("torch._dynamo")  # torch sets TORCHINDUCTOR_CACHE_DIR on import

    make_encoder(tmp_path, "bert")
    before_threads, before_environment = torch.get_num_threads(), dict(os.environ)
    torch.set_num_threads(1)
    try:
        llm = LLM(str(tmp_path), dtype="float32")
        assert llm.config.num_threads is None
        assert torch.get_num_threads() == 1 and dict(os.environ) == before_environment
        LLM(str(tmp_path), dtype="float32", num_threads=NUM_THREADS)  # asked: set
        assert torch.get_num_threads() == NUM_THREADS and dict(os.environ) == before_environment
    finally:
        torch.set_num_threads(before_threads)


def test_the_core_environment_is_the_childs_only(monkeypatch) -> None:
    (name,) = CORE_ENVIRONMENT
    monkeypatch.delenv(name, raising=False)
    with child_environment(CORE_ENVIRONMENT):
        assert os.environ[name] == CORE_ENVIRONMENT[name]  # what a child started now inherits
    assert name not in os.environ
    monkeypatch.setenv(name, "7")  # the user's own value wins and stays
    with child_environment(CORE_ENVIRONMENT):
        assert os.environ[name] == "7"
    assert os.environ[name] == "7"


def test_the_server_core_process_gets_the_spin_count(default_server) -> None:
    (name,) = CORE_ENVIRONMENT
    if name in os.environ:
        pytest.skip(f"{name} is set in this environment")
    environ = Path(f"/proc/{default_server.engine_pid()}/environ").read_bytes().split(b"\0")
    assert f"{name}={CORE_ENVIRONMENT[name]}".encode() in environ


# ---- the GGUF file is read once and travels explicitly ----------------------------------------


def test_a_gguf_is_read_once_per_process_and_named_by_its_file(monkeypatch) -> None:
    reads = []
    build_tokenizer = gguf_loader.build_tokenizer

    def counting(reader):
        reads.append(reader)
        return build_tokenizer(reader)

    monkeypatch.setattr(gguf_loader, "build_tokenizer", counting)
    path = find_smollm2_gguf()
    config = EngineArgs(model=str(path), max_num_batched_tokens=64).create_engine_config()
    # a causal model's prompts are chunked: any positive token budget works
    assert config.scheduler.enable_chunked_prefill and config.model.max_model_len > 64
    model_config = config.model
    tokenizer, template = load_tokenizer(model_config), load_chat_template(model_config)
    assert len(reads) == 1 and model_config.gguf is not None
    assert model_config.served_model_name == path.name  # never this machine's path
    assert tokenizer is model_config.gguf.tokenizer and template
    # another process (the server's engine core) re-opens the file from its path
    copy = pickle.loads(pickle.dumps(model_config))
    assert len(reads) == 2 and copy.gguf is not model_config.gguf
    assert copy == model_config and copy.gguf.path == path


# ---- the API key ---------------------------------------------------------------------------------


def test_the_api_key_comes_from_the_environment_and_stays_out_of_help(monkeypatch) -> None:
    monkeypatch.setenv("CENOTE_API_KEY", "s3cret-key")
    assert cli._api_key(None) == "s3cret-key"
    assert cli._api_key("given") == "given"
    assert "s3cret-key" not in _subparser("serve").format_help()
    monkeypatch.setenv("CENOTE_API_KEY", "")
    assert cli._api_key(None) is None
