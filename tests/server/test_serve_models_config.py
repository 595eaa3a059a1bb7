"""``cenote serve``'s several-model options without starting a server: ``--model NAME=PATH``
and ``--config`` read into model specs, the errors that name the model, and the CPU policy
between engine cores (engine/cpu_shares.py)."""

from __future__ import annotations

import json

import pytest

from cenote.cli.main import _parser, _served_models
from cenote.cli.model_specs import model_specs
from cenote.engine.cpu_shares import CoreShare, plan_cpu_shares, share_cpus
from cenote.engine_args import EngineArgs
from cenote.server.state import ServerOptions


def _specs(*argv: str):
    return model_specs(_parser().parse_args(["serve", *argv]))


# ---- the CPU policy ------------------------------------------------------------------------


def test_enough_cpus_give_each_core_a_disjoint_set():
    """8 CPUs, 3 cores (one model of 2 replicas, one of 1): 2.67 CPUs a core -> runs of
    3, 3, 2; the two-replica model holds the first six."""
    shares = plan_cpu_shares([2, 1], range(8))
    assert shares == [CoreShare(6, (0, 1, 2, 3, 4, 5)), CoreShare(2, (6, 7))]


def test_exactly_two_cpus_a_core_still_pins():
    assert plan_cpu_shares([1, 1], [4, 5, 6, 7]) == [CoreShare(2, (4, 5)), CoreShare(2, (6, 7))]


def test_fewer_than_two_cpus_a_core_share_one_set_with_threads_summing_to_the_cpus():
    assert plan_cpu_shares([1, 1, 1], range(5)) == [
        CoreShare(2, None), CoreShare(2, None), CoreShare(1, None),
    ]  # fmt: skip
    # this machine's case: 2 CPUs, 2 models
    assert plan_cpu_shares([1, 1], [0, 1]) == [CoreShare(1, None), CoreShare(1, None)]


def test_more_cores_than_cpus_get_one_thread_each():
    assert plan_cpu_shares([1, 1, 1], [0, 1]) == [CoreShare(1, None)] * 3


def test_models_left_alone_take_no_share():
    """A model with its own num_threads (None) is skipped; the others split every CPU."""
    assert plan_cpu_shares([None, 1, 1], range(4)) == [
        None, CoreShare(2, (0, 1)), CoreShare(2, (2, 3)),
    ]  # fmt: skip


def test_share_cpus_keeps_a_models_own_thread_count(minilm_path):
    config = EngineArgs(str(minilm_path), dtype="float32").create_engine_config()
    own = EngineArgs(str(minilm_path), dtype="float32", num_threads=3).create_engine_config()
    first, second = share_cpus([config, own], [1, 1], range(4))
    assert (first.num_threads, first.cpu_ids) == (4, (0, 1, 2, 3))
    assert (second.num_threads, second.cpu_ids) == (3, None)


# ---- --model and --config ---------------------------------------------------------------------


def test_one_model_is_served_as_before(minilm_path):
    for argv in ([str(minilm_path)], ["--model", str(minilm_path)]):
        (spec,) = _specs(*argv, "--served-model-name", "m")
        assert spec.name is None and spec.engine_args.model == str(minilm_path)
        assert spec.engine_args.served_model_name == "m"


def test_named_models_and_a_config_file(tmp_path, minilm_path):
    (tmp_path / "models").mkdir()
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": {"small": {
        "model": str(minilm_path), "max_model_len": 128, "kv_cache_memory_bytes": "64MiB",
        "data_parallel_size": 2, "chat_template": "{{ x }}",
    }}}))  # fmt: skip
    specs = _specs("--model", f"a={minilm_path}", "--config", str(config), "--dtype", "float32")
    assert [spec.name for spec in specs] == ["a", "small"]
    small = specs[1].engine_args
    assert (small.dtype, small.max_model_len, small.kv_cache_memory_bytes) == (
        "float32", 128, 64 << 20,
    )  # fmt: skip
    assert specs[1].options == {"data_parallel_size": 2, "chat_template": "{{ x }}"}
    assert specs[0].engine_args.max_model_len is None  # the command line's default


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ({"m": {"model": "x", "dtpye": "float32"}},
         "model 'm' has an unknown option 'dtpye' (did you mean 'dtype'?)"),
        ({"m": {"model": "x", "max_model_len": "long"}},
         "model 'm': option max_model_len must be int or None, got 'long'"),
        ({"m": {"model": "x", "data_parallel_size": 0}},
         "model 'm', data_parallel_size must be a positive integer, got 0"),
        ({"m": {"dtype": "float32"}}, "model 'm' must be an object with a 'model' path"),
        ({}, 'expected {"models": {"NAME": {"model": PATH, ...}}}'),
    ],
)  # fmt: skip
def test_config_file_errors_name_the_model_and_option(tmp_path, models, message):
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": models}))
    with pytest.raises(ValueError, match="^--config") as error:
        _specs("--config", str(config))
    assert message in str(error.value)


def test_command_line_errors(minilm_path, tmp_path):
    with pytest.raises(ValueError, match="2 models have no name"):
        _specs(str(minilm_path), "--model", str(minilm_path))
    with pytest.raises(ValueError, match=r"models named more than once: \['a'\]"):
        _specs("--model", f"a={minilm_path}", "--model", f"a={minilm_path}")
    with pytest.raises(ValueError, match="--served-model-name names one model"):
        _specs("--model", f"a={minilm_path}", "--model", f"b={minilm_path}",
               "--served-model-name", "x")  # fmt: skip
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        _specs("--model", "=path")
    with pytest.raises(ValueError, match="cannot read it"):
        _specs("--config", str(tmp_path / "missing.json"))


def test_a_model_that_cannot_be_read_fails_the_start_naming_it(minilm_path, tmp_path):
    specs = _specs("--model", f"good={minilm_path}", "--model", f"bad={tmp_path / 'nowhere'}")
    with pytest.raises(ValueError, match="^model 'bad': "):
        _served_models(specs, ServerOptions())
