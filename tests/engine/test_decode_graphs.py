"""CUDA graphs for all-decode steps (cenote/runner/decode_graphs.py), checked on the host: the
padded sizes, which steps replay, what a replay's static inputs hold (real rows as the eager
plan builds them, padding rows on the scratch block), and the whole engine on the CPU with the host's
stand-in graph (which runs the same staging and preset plans) against ``enforce_eager``:
bit-identical tokens and logprobs. The graphs themselves run in benchmarks/gpu_check.py."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from factories.decoders import make_decoder
from factories.generation import make_llm, random_prompts, token_prompts

from cenote import SamplingParams
from cenote.cli import main as cli
from cenote.engine_args import EngineArgs
from cenote.forward_context import get_attention_metadata
from cenote.models.layers.attention_plan import paged_plan
from cenote.platforms import CpuPlatform, CudaPlatform, uses_cuda_graphs
from cenote.pooling_params import PoolingParams
from cenote.runner.batch import build_input_batch
from cenote.runner.decode_graphs import (
    CudaGraph,
    DecodeGraphs,
    capture_sizes,
    graph_size,
    is_decode_step,
)
from cenote.sampling_params import SamplingParams as Params
from cenote.scheduler.output import ScheduledRequest

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32  # tables of 8 blocks
NUM_BLOCKS = 10
SCRATCH = NUM_BLOCKS  # the block after the manager's


def _request(
    name: str, position: int, block_ids: list[int], num_tokens: int = 1, **fields
) -> ScheduledRequest:
    values = dict(
        request_id=name,
        token_ids=[10 + position + i for i in range(num_tokens)],
        start_position=position,
        block_ids=block_ids,
        prompt_token_ids=[5] * (position + num_tokens),
        output_token_ids=[],
        token_type_ids=None,
        sampling_params=Params(),
        pooling_params=None,
        eos_token_id=None,
        completes_prompt=False,
        needs_sample=True,
    )
    values.update(fields)
    return ScheduledRequest(**values)


# ---- sizes and eligibility -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [(1, [1]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8]), (256, [1, 2, 4, 8, 16, 32, 64, 128, 256])],
)
def test_capture_sizes_are_powers_of_two_then_max_num_seqs(max_num_seqs, sizes) -> None:
    assert capture_sizes(max_num_seqs) == sizes


@pytest.mark.parametrize(("rows", "size"), [(1, 1), (2, 2), (3, 4), (5, 6), (6, 6), (7, None)])
def test_a_step_runs_the_smallest_size_that_holds_it(rows, size) -> None:
    assert graph_size(rows, capture_sizes(6)) == size


def test_only_steps_whose_rows_all_decode_on_the_base_model_are_eligible() -> None:
    decode = [_request("a", 3, [0]), _request("b", 0, [1])]  # a one-token prompt decodes too
    assert is_decode_step(decode)
    assert not is_decode_step([])
    assert not is_decode_step([*decode, _request("p", 0, [2], num_tokens=3)])  # a prompt chunk
    pooled = _request("e", 0, [2], sampling_params=None, pooling_params=PoolingParams())
    assert not is_decode_step([*decode, pooled])
    assert not is_decode_step([*decode, _request("l", 4, [3, 4], lora_int_id=1)])
    assert not is_decode_step([*decode, _request("t", 4, [3, 4], token_type_ids=[0])])


# ---- what a replay reads ---------------------------------------------------------------------


class _RecordingTrunk:
    """A decoder trunk that records the inputs and decode plans of every pass."""

    attention_windows = (None, 5)

    def __init__(self) -> None:
        self.passes: list[dict] = []

    def __call__(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        metadata = get_attention_metadata()
        plans = {}
        for window in self.attention_windows:
            plan = paged_plan(metadata, window)
            assert plan.all_decode
            plans[window] = (
                plan.decode_tables.clone(),
                plan.decode_starts.clone(),
                plan.decode_ends.clone(),
            )
        self.passes.append(
            dict(
                input_ids=input_ids.clone(),
                positions=positions.clone(),
                slots=metadata.slot_mapping.clone(),
                plans=plans,
            )
        )
        return input_ids.float().unsqueeze(1).repeat(1, 3)  # [rows, 3]


def _graphs(trunk: _RecordingTrunk, max_num_seqs: int = 4) -> DecodeGraphs:
    return DecodeGraphs(
        trunk,
        [torch.zeros(1)],
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max_num_seqs,
        scratch_block=SCRATCH,
        device=torch.device("cpu"),
    )


def test_sizes_are_captured_largest_first_over_padding_rows_on_the_scratch_block() -> None:
    trunk = _RecordingTrunk()
    _graphs(trunk).capture()
    assert [len(p["input_ids"]) for p in trunk.passes] == [4, 2, 1]
    for recorded in trunk.passes:
        assert recorded["slots"].tolist() == [SCRATCH * BLOCK_SIZE] * len(recorded["slots"])
        for tables, starts, ends in recorded["plans"].values():
            assert tables.shape[1] == MAX_MODEL_LEN // BLOCK_SIZE  # full width, fixed
            assert (tables[:, 0] == SCRATCH).all()
            assert starts.tolist() == [0] * len(starts) and ends.tolist() == [1] * len(ends)


def test_a_replay_reads_the_eager_plans_of_its_rows_then_padding_rows() -> None:
    trunk = _RecordingTrunk()
    graphs = _graphs(trunk)
    graphs.capture()
    # positions 0, 9 and 14: window 5 drops the first blocks of the last one
    scheduled = [
        _request("a", 0, [3]),
        _request("b", 9, [5, 1, 7]),
        _request("c", 14, [2, 6, 0, 4]),
    ]
    assert graphs.takes(scheduled)
    hidden = graphs.run(scheduled)
    assert hidden[:, 0].tolist() == [10.0, 19.0, 24.0]  # the trunk's rows of the real requests
    replay = trunk.passes[-1]
    assert len(replay["input_ids"]) == 4  # 3 rows padded to the size 4
    eager = build_input_batch(scheduled, BLOCK_SIZE, [torch.zeros(1)], MAX_MODEL_LEN)
    assert replay["input_ids"].tolist() == [*eager.input_ids.tolist(), 0]
    assert replay["positions"].tolist() == [*eager.positions.tolist(), 0]
    assert replay["slots"].tolist() == [*eager.attention.slot_mapping.tolist(), SCRATCH * 4]
    for window, (tables, starts, ends) in replay["plans"].items():
        plan = paged_plan(eager.attention, window)
        assert starts.tolist() == [*plan.decode_starts.tolist(), 0]
        assert ends.tolist() == [*plan.decode_ends.tolist(), 1]
        for row, end in enumerate(plan.decode_ends.tolist()):  # the entries the kernels read
            used = -(-end // BLOCK_SIZE)
            assert tables[row, :used].tolist() == plan.decode_tables[row, :used].tolist()
        assert tables[3, 0] == SCRATCH
    assert replay["plans"][5][1].tolist() == [0, 1, 2, 0]  # c sees table keys 2..6 of [0, 4]


def test_a_smaller_step_after_a_larger_one_replays_its_own_size() -> None:
    trunk = _RecordingTrunk()
    graphs = _graphs(trunk)
    graphs.capture()
    graphs.run([_request(str(i), 13, [i, 5, 6, 7]) for i in range(4)])
    hidden = graphs.run([_request("x", 2, [8])])
    assert hidden.shape == (1, 3)
    replay = trunk.passes[-1]
    assert replay["input_ids"].tolist() == [12] and replay["slots"].tolist() == [8 * 4 + 2]
    tables, starts, ends = replay["plans"][None]
    assert tables[0, 0] == 8 and starts.tolist() == [0] and ends.tolist() == [3]
    assert not graphs.takes([_request(str(i), 0, [i]) for i in range(5)])  # above the largest


def test_a_cuda_graph_warms_up_then_captures_into_the_shared_pool(monkeypatch) -> None:
    """The calls ``CudaGraph`` makes, against stand-ins with torch's names (the real ones need a
    GPU): a warm-up pass, a synchronize, one pass inside ``torch.cuda.graph(pool=...)``, then
    replays that return the captured output."""
    import inspect

    assert "pool" in inspect.signature(torch.cuda.graph).parameters
    calls: list = []

    class FakeCUDAGraph:
        def replay(self) -> None:
            calls.append("replay")

    @contextmanager
    def fake_graph(graph, pool=None):
        calls.append(("capture", type(graph).__name__, pool))
        yield
        calls.append("end")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    output = torch.ones(2)
    graph = CudaGraph(pool="pool")
    graph.capture(lambda: calls.append("forward") or output)
    assert calls == ["forward", "sync", ("capture", "FakeCUDAGraph", "pool"), "forward", "end"]
    assert graph.replay() is output and calls[-1] == "replay"


# ---- the engine with the host's stand-in graph -----------------------------------------------

SLIDING = dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)


def _generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outputs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [
        [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs]
        for o in outputs
    ]
    return tokens, logprobs


@pytest.mark.parametrize(("family", "overrides"), [("llama", {}), ("qwen2", SLIDING)])
def test_replayed_steps_equal_eager_bit_for_bit(family, overrides, tmp_path: Path, monkeypatch):
    make_decoder(tmp_path, family, **overrides)
    prompts = random_prompts([1, 6, 11], seed=3)  # decode batches of 3 (padded to 4), then 1
    eager = make_llm(tmp_path, device="cpu", block_size=4, enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    expected = _generate(eager, prompts[:1]), _generate(eager, prompts)
    del eager

    monkeypatch.setattr("cenote.engine_args.uses_cuda_graphs", lambda device, eager: not eager)
    llm = make_llm(tmp_path, device="cpu", block_size=4, num_gpu_blocks_override=80, max_num_seqs=4)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4]
    assert llm.engine.runner.kv_caches[0].shape[2] == 81  # the scratch block after the 80
    assert llm.engine.kv_cache_manager.num_blocks == 80
    replayed = []
    original = graphs.run
    monkeypatch.setattr(
        graphs, "run", lambda scheduled: replayed.append(len(scheduled)) or original(scheduled)
    )
    assert (_generate(llm, prompts[:1]), _generate(llm, prompts)) == expected
    assert 1 in replayed and 3 in replayed  # alone, then three streams in one replay


# ---- enforce_eager ---------------------------------------------------------------------------


def test_graphs_are_on_for_cuda_unless_enforce_eager_and_never_on_the_cpu() -> None:
    assert uses_cuda_graphs(CudaPlatform(), enforce_eager=False)
    assert not uses_cuda_graphs(CudaPlatform(), enforce_eager=True)
    assert not uses_cuda_graphs(CpuPlatform(), enforce_eager=False)
    assert EngineArgs().enforce_eager is False


def test_enforce_eager_reaches_the_engine_args_from_the_command_line() -> None:
    parser = cli._parser()
    args = parser.parse_args(["serve", "some/model", "--enforce-eager"])
    assert EngineArgs.from_cli_args(args).enforce_eager is True
    args = parser.parse_args(["serve", "some/model"])
    assert EngineArgs.from_cli_args(args).enforce_eager is False


def test_the_cpu_engine_captures_nothing(tmp_path: Path) -> None:
    make_decoder(tmp_path, "llama")
    llm = make_llm(tmp_path, device="cpu")
    assert llm.config.cuda_graphs is False and llm.engine.runner.decode_graphs is None
    assert llm.engine.runner.kv_caches[0].shape[2] == llm.engine.kv_cache_manager.num_blocks


def test_a_failed_capture_leaves_the_engine_eager_and_serving(tmp_path: Path, monkeypatch, caplog):
    """A capture that raises (an op that cannot be captured, the graphs' memory) is a warning
    naming the cause, and every step runs eagerly: the same tokens as enforce_eager."""
    make_decoder(tmp_path, "llama")
    prompts = random_prompts([2, 5], seed=4)
    eager = make_llm(tmp_path, device="cpu", block_size=4, enforce_eager=True)
    expected = _generate(eager, prompts)
    del eager

    def fails(self) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("cenote.engine_args.uses_cuda_graphs", lambda device, eager: not eager)
    monkeypatch.setattr("cenote.runner.decode_graphs.DecodeGraphs.capture", fails)
    with caplog.at_level("WARNING", logger="cenote.runner.model_runner"):
        llm = make_llm(tmp_path, device="cpu", block_size=4, num_gpu_blocks_override=80)
    assert llm.engine.runner.decode_graphs is None
    assert "CUDA graph capture failed (RuntimeError: operation not permitted" in caplog.text
    assert _generate(llm, prompts) == expected
