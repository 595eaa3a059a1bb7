"""The device seam (cenote/platforms): choosing the platform and dtype, what a CPU's features
decide, refusing what has no CUDA path, and the dispatch that never hands a tensor off the host
to cenote's C++ kernels (checked with ``meta`` tensors, which no CPU kernel can read)."""

from __future__ import annotations

import argparse
import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from factories.decoders import make_decoder
from factories.encoders import make_encoder
from factories.texts import PARITY_TEXTS

from cenote.engine_args import EngineArgs
from cenote.forward_context import AttentionMetadata, forward_context
from cenote.kernels import ops
from cenote.models.layers.attention import Attention
from cenote.models.layers.attention_plan import paged_plan
from cenote.models.layers.linear import TrunkLinear
from cenote.models.layers.norm import LayerNorm
from cenote.platforms import (
    DEFAULT_KV_CACHE_BYTES,
    CpuPlatform,
    CudaPlatform,
    num_gpu_kv_blocks,
    pack,
    resolve_device,
    resolve_platform,
    runs_cpu_kernels,
    to_device,
    unpack,
)
from cenote.runner.batch import build_input_batch
from cenote.runner.memory_profile import dummy_prompt_lengths, graph_reserve_bytes
from cenote.sampling.sampler import mask_allowed, numpy_mask_allowed
from cenote.scheduler.output import ScheduledRequest

# a Zen 4/5 (AVX512-bf16, VNNI, no AMX), a Sapphire Rapids (AMX) and a Zen 3 (AVX2 only)
ZEN4 = CpuPlatform(frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}))
SAPPHIRE_RAPIDS = CpuPlatform(
    frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"})
)
ZEN3 = CpuPlatform(frozenset({"avx2", "fma", "f16c"}))
H200 = CudaPlatform(capability=(9, 0))


def _cuda(monkeypatch: pytest.MonkeyPatch, available: bool, capability=(9, 0)) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)


# ---- choosing the device and dtype -------------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "available", "expected"),
    [("auto", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu"), ("cuda", True, "cuda")],
)
def test_device_resolution(monkeypatch, asked, available, expected) -> None:
    _cuda(monkeypatch, available)
    assert resolve_device(asked) == expected


def test_cuda_without_a_device_is_refused_naming_the_option(monkeypatch) -> None:
    _cuda(monkeypatch, False)
    with pytest.raises(ValueError, match=r"device='cuda' \(--device cuda\).*no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        resolve_device("tpu")


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16), ((7, 5), torch.float16)],
)
def test_auto_dtype_on_cuda_follows_compute_capability(monkeypatch, capability, expected) -> None:
    _cuda(monkeypatch, True, capability)
    platform = resolve_platform("cuda")
    assert isinstance(platform, CudaPlatform)
    assert platform.resolve_dtype("auto") == expected  # the device's capability, read at use
    assert CudaPlatform(capability=capability).resolve_dtype("auto") == expected
    assert platform.resolve_dtype("float32") == torch.float32  # an explicit dtype wins
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; choose one of auto, float32"):
        platform.resolve_dtype("fp8")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("platform", "dtype", "in_norm", "int8"),
    [
        (ZEN4, torch.bfloat16, True, True),
        (SAPPHIRE_RAPIDS, torch.bfloat16, False, True),  # AMX keeps oneDNN's epilogue
        (ZEN3, torch.float32, False, False),  # bf16 is ~70x slower without native bf16
        (CpuPlatform(frozenset()), torch.float32, False, False),
    ],
)
def test_the_cpus_features_pick_the_default_dtype_and_the_fast_paths(
    platform, dtype, in_norm, int8
) -> None:
    assert platform.resolve_dtype("auto") == dtype
    assert platform.supports("bf16_fast") == (dtype == torch.bfloat16)
    assert platform.supports("residual_add_in_norm") == in_norm
    assert platform.supports("int8_dot_products") == int8
    assert platform.supports("cpu_kernels") and not platform.supports("cuda_graphs")
    assert platform.features() == {
        f for f in ("bf16_fast", "residual_add_in_norm", "int8_dot_products", "cpu_kernels")
        if platform.supports(f)
    }  # fmt: skip
    assert platform.resolve_dtype("float16") == torch.float16  # an explicit dtype wins


def test_an_unknown_feature_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown platform feature 'bf16'; known: bf16_fast"):
        ZEN4.supports("bf16")  # type: ignore[arg-type]


def test_cuda_has_graphs_and_no_cpu_kernels() -> None:
    assert H200.supports("cuda_graphs") and H200.supports("bf16_fast")
    assert not H200.supports("cpu_kernels") and not H200.supports("residual_add_in_norm")
    assert not CudaPlatform(capability=(7, 5)).supports("bf16_fast")
    assert H200.hardware() == "GPU has compute capability 9.0"
    assert ZEN3.hardware() == "CPU has avx2, f16c, fma"


def test_a_cuda_platform_on_a_cpu_only_torch_is_refused_naming_the_option(monkeypatch) -> None:
    _cuda(monkeypatch, False)
    with pytest.raises(ValueError, match=r"device='cuda' \(--device cuda\).*no CUDA device"):
        resolve_platform("cuda")
    assert isinstance(resolve_platform("auto"), CpuPlatform)
    _cuda(monkeypatch, True)
    assert isinstance(resolve_platform("auto"), CudaPlatform)


def test_the_platform_decides_the_residual_add_of_every_trunk_linear(tmp_path: Path) -> None:
    """The loader hands the engine config's platform to the layers: a BERT trunk's residual
    adds run in the norm on an AVX512-bf16 CPU without AMX, in the matmul's epilogue on AMX."""
    from cenote.models.config_reader import read_model_config
    from cenote.models.loader import load_model

    make_encoder(tmp_path, "bert")
    model_config = read_model_config(tmp_path, dtype="bfloat16", platform=ZEN3)
    for platform, in_norm in ((ZEN4, True), (SAPPHIRE_RAPIDS, False)):
        model = load_model(model_config, platform)
        layers = [m for m in model.modules() if isinstance(m, TrunkLinear)]
        assert layers and all(m.adds_residual_in_norm == in_norm for m in layers)


def test_the_engine_config_holds_the_platform_and_it_travels_by_its_facts(
    minilm_path: Path,
) -> None:
    config = EngineArgs(str(minilm_path), device="cpu").create_engine_config()
    assert isinstance(config.platform, CpuPlatform) and config.platform.flags is None
    assert config.model.dtype == config.platform.default_dtype()
    # a given machine keeps its facts across a process; this machine's is read again there
    assert pickle.loads(pickle.dumps(ZEN3)) == ZEN3
    assert pickle.loads(pickle.dumps(config)).platform == CpuPlatform()
    with pytest.raises(ValueError, match="the cuda platform cannot run a model on 'cpu'"):
        dataclasses.replace(config, platform=H200)


def test_the_default_kv_budget_is_a_quarter_of_the_available_memory_at_most_1_gib() -> None:
    budget = ZEN4.kv_cache_budget_bytes()
    assert 0 < budget <= DEFAULT_KV_CACHE_BYTES == 1 << 30


def test_cpu_options_and_cpu_kernels_are_refused_on_cuda() -> None:
    with pytest.raises(ValueError, match=r"num_threads \(--num-threads 4\).*device='cuda'"):
        H200.check_options(num_threads=4, quantization="auto")
    for method in ("int8", "int4", "w8a8"):
        with pytest.raises(ValueError, match=f"quantization='{method}'.*no cuda path"):
            H200.check_options(num_threads=None, quantization=method)
    H200.check_options(num_threads=None, quantization="none")
    ZEN3.check_options(num_threads=4, quantization="w8a8")  # the CPU has them all


@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.01, 9.0])
def test_gpu_memory_utilization_outside_0_1_is_refused_with_the_number(utilization) -> None:
    for platform in (H200, ZEN4):
        with pytest.raises(ValueError, match=rf"must be in \(0, 1\], got {utilization}"):
            platform.check_options(
                num_threads=None, quantization="auto", gpu_memory_utilization=utilization
            )
    H200.check_options(num_threads=None, quantization="auto", gpu_memory_utilization=1)


def test_gpu_memory_utilization_given_with_the_cpu_is_refused_naming_the_option(
    minilm_path: Path,
) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 .*device='cpu'"):
        EngineArgs(
            str(minilm_path), device="cpu", gpu_memory_utilization=0.5
        ).create_engine_config()
    config = EngineArgs(str(minilm_path), device="cpu").create_engine_config()  # the default
    assert config.cache.gpu_memory_utilization == 0.9
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5


GiB, MiB = 1 << 30, 1 << 20


def _blocks(**numbers: float) -> int:
    """``num_gpu_kv_blocks`` of an H200 (140 GiB, all free) at 0.9 with Llama-8B bf16 (16 GiB
    of weights, 1 GiB of activations, 2 MiB blocks) and 0.5 GiB of graphs, changed by
    ``numbers``."""
    given = dict(
        total_bytes=140 * GiB,
        utilization=0.9,
        peak_bytes=17 * GiB,
        activation_bytes=1 * GiB,
        free_bytes=140 * GiB,
        graph_reserve_bytes=GiB // 2,
        bytes_per_block=2 * MiB,
    )
    given.update(numbers)
    return num_gpu_kv_blocks(**{k: int(v) if k != "utilization" else v for k, v in given.items()})


def test_kv_blocks_fill_the_fraction_left_by_the_weights_the_step_and_the_graphs() -> None:
    assert _blocks() == (int(140 * GiB * 0.9) - 17 * GiB - GiB // 2) // (2 * MiB)
    assert _blocks(utilization=0.45) == (int(140 * GiB * 0.45) - 17 * GiB - GiB // 2) // (2 * MiB)
    # another engine holds 100 GiB: the free memory bounds the cache, not the fraction
    assert _blocks(free_bytes=24 * GiB) == (24 * GiB - GiB - GiB // 2) // (2 * MiB)


@pytest.mark.parametrize(
    ("numbers", "phrases"),
    [
        ({"total_bytes": 16 * GiB, "free_bytes": 16 * GiB, "utilization": 0.1,
          "peak_bytes": 8 * GiB},
         ["gpu_memory_utilization=0.1 of the GPU's 16.00 GiB is 1.60 GiB", "peak at 8.00 GiB",
          "CUDA graphs take 0.50 GiB", "block of 2.0 MiB",
          "raise --gpu-memory-utilization (at least 0.532)", "--max-num-batched-tokens"]),
        ({"total_bytes": 16 * GiB, "free_bytes": 16 * GiB, "peak_bytes": 20 * GiB},
         ["peak at 20.00 GiB", "the GPU cannot hold it at any utilization"]),
        ({"free_bytes": 1 * GiB},
         ["the GPU has 1.00 GiB free of 140.00 GiB (other engines or processes",
          "activations take 1.00 GiB and CUDA graphs 0.50 GiB",
          "lower the other engines' --gpu-memory-utilization"]),
    ],
)  # fmt: skip
def test_no_room_for_one_kv_block_is_refused_with_the_numbers(numbers, phrases) -> None:
    with pytest.raises(ValueError, match="no room for the KV cache") as error:
        _blocks(**numbers)
    for phrase in phrases:
        assert phrase in str(error.value)


@pytest.mark.parametrize(
    ("num_tokens", "max_num_seqs", "max_model_len", "expected"),
    [
        (16384, 1024, 2048, [16] * 1024),
        (10, 4, 2048, [3, 3, 2, 2]),
        (3, 8, 2048, [1, 1, 1]),
        (8192, 2, 2048, [2048] * 4),  # max_model_len bounds a request: more requests
    ],
)
def test_the_profiling_step_splits_the_token_budget_evenly(
    num_tokens, max_num_seqs, max_model_len, expected
) -> None:
    lengths = dummy_prompt_lengths(num_tokens, max_num_seqs, max_model_len)
    assert lengths == expected
    assert sum(lengths) == num_tokens


def test_the_profiling_step_runs_through_a_runner_and_samples_every_request(
    tmp_path: Path,
) -> None:
    """The dummy batch is a step the runner takes (on the host here; CUDA reads its peak)."""
    from cenote import LLM
    from cenote.models.layers.attention import kv_cache_shape
    from cenote.runner.memory_profile import dummy_step
    from cenote.runner.model_runner import ModelRunner

    make_decoder(tmp_path, "llama")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_gpu_blocks_override=64)
    engine = llm.engine
    lengths = dummy_prompt_lengths(300, 8, 256)
    step = dummy_step(lengths, block_size=16)
    num_blocks = sum(len(s.block_ids) for s in step.scheduled)
    assert num_blocks == sum(-(-n // 16) for n in lengths)
    shape = kv_cache_shape(num_blocks, 16, 2, 16)
    kv_caches = [torch.zeros(shape) for _ in range(2)]
    output = ModelRunner(engine.config, engine.model, engine.pooler, kv_caches).execute(step)
    assert sorted(output.sampled_token_ids) == sorted(s.request_id for s in step.scheduled)


def test_a_failed_profiling_step_falls_back_and_running_out_of_memory_is_named(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """The profile (CUDA) that raises sizes the cache from the default budget with a warning;
    one that runs out of GPU memory is a start-up error naming the step's budget."""
    from cenote import LLM
    from cenote.engine import core

    make_decoder(tmp_path, "llama")
    engine = LLM(str(tmp_path), device="cpu", dtype="float32", num_gpu_blocks_override=16).engine

    def fails(*args: object) -> None:
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(core, "profile_step_peak", fails)
    with caplog.at_level("WARNING", logger="cenote.engine.core"):
        assert engine._profile_kv_blocks(8192) is None
    assert "profiling step failed (RuntimeError: no kernel image" in caplog.text

    def out_of_memory(*args: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(core, "profile_step_peak", out_of_memory)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8192\) tokens ran out"):
        engine._profile_kv_blocks(8192)


def test_a_gpu_kv_cache_below_one_longest_request_names_gpu_memory_utilization(
    tmp_path: Path,
) -> None:
    from cenote.engine.core import _check_kv_cache_fits

    make_decoder(tmp_path, "llama")  # max_model_len 256: 16 blocks of 16 tokens, 8 KiB each
    config = EngineArgs(str(tmp_path), device="cpu", dtype="float32").create_engine_config()
    cuda = dataclasses.replace(
        config, model=dataclasses.replace(config.model, device="cuda"), platform=H200
    )
    with pytest.raises(ValueError) as error:
        _check_kv_cache_fits(cuda, 10, 8192, None)
    message = str(error.value)
    assert "the cache has 10 blocks (80.0 KiB, from gpu_memory_utilization=0.9)" in message
    assert "raise gpu_memory_utilization (--gpu-memory-utilization) by 48.0 KiB" in message
    assert "lower max_model_len (--max-model-len) to at most 160" in message


def test_the_graph_reserve_scales_the_step_to_the_largest_graph(minilm_path: Path) -> None:
    config = EngineArgs(str(minilm_path), device="cpu", max_num_seqs=256).create_engine_config()
    assert graph_reserve_bytes(config, 8192 * MiB) == 0  # no graphs on the CPU
    graphs = dataclasses.replace(config, cuda_graphs=True)  # 256 rows of an 8,192-token step
    assert graph_reserve_bytes(graphs, 8192 * MiB) == 256 * MiB


def test_engine_args_resolve_the_device_before_reading_the_model(
    monkeypatch, minilm_path: Path
) -> None:
    _cuda(monkeypatch, True)
    with pytest.raises(ValueError, match="num_threads"):
        EngineArgs(str(minilm_path), device="cuda", num_threads=2).create_engine_config()
    _cuda(monkeypatch, False)
    config = EngineArgs(str(minilm_path), device="auto").create_engine_config()
    assert config.model.device == "cpu"
    with pytest.raises(TypeError, match="option device must be one of 'auto', 'cpu', 'cuda'"):
        EngineArgs(str(minilm_path), device="gpu")  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "gpu"])


def test_steps_are_larger_by_default_on_cuda(monkeypatch, minilm_path: Path) -> None:
    """vLLM's offline defaults for large GPUs: 16,384 tokens and 1,024 requests a step (the
    host's work per step is what a GPU pass waits on); the CPU keeps 8,192 and 256, and an
    option given is kept on either."""
    cpu = EngineArgs(str(minilm_path), device="cpu").create_engine_config().scheduler
    assert (cpu.max_num_batched_tokens, cpu.max_num_seqs) == (8192, 256)
    _cuda(monkeypatch, True)
    cuda = EngineArgs(str(minilm_path), device="cuda").create_engine_config().scheduler
    assert (cuda.max_num_batched_tokens, cuda.max_num_seqs) == (16384, 1024)
    given = EngineArgs(
        str(minilm_path), device="cuda", max_num_batched_tokens=4096, max_num_seqs=8
    ).create_engine_config()
    assert (given.scheduler.max_num_batched_tokens, given.scheduler.max_num_seqs) == (4096, 8)


def test_data_parallel_engine_cores_are_refused_on_one_gpu(minilm_path: Path) -> None:
    pytest.importorskip("zmq", reason="the server's dependencies (a GPU box may lack them)")
    from cenote.engine.dp_client import split_cores

    config = EngineArgs(str(minilm_path), device="cpu").create_engine_config()
    cuda = dataclasses.replace(
        config, model=dataclasses.replace(config.model, device="cuda"), platform=H200
    )
    with pytest.raises(ValueError, match="data_parallel_size 2 .* share one GPU"):
        split_cores(cuda, 2)
    assert len(split_cores(config, 1)) == 1


# ---- the kernel dispatch -----------------------------------------------------------------------


def test_the_kernel_decision_is_by_device() -> None:
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    assert runs_cpu_kernels(cpu) and runs_cpu_kernels(cpu, cpu)
    assert not runs_cpu_kernels(meta) and not runs_cpu_kernels(cpu, meta)
    norm = LayerNorm(8).to(torch.bfloat16)
    with torch.inference_mode():
        assert norm.runs_in_place(torch.zeros(3, 8, dtype=torch.bfloat16))
        assert not norm.runs_in_place(torch.zeros(3, 8, dtype=torch.bfloat16, device="meta"))


class _SpyOps:
    """Stands for the C++ attention ops: records each call's device, answers like them."""

    def __init__(self) -> None:
        self.devices: list[str] = []

    def varlen_attention(self, q, *args) -> None:
        self.devices.append(q.device.type)

    def paged_attention(self, q, *args) -> torch.Tensor:
        self.devices.append(q.device.type)
        return torch.empty_like(q)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_attention_hands_only_host_tensors_to_the_kernels(monkeypatch, device) -> None:
    spy = _SpyOps()
    ops.load()
    monkeypatch.setattr(ops, "_attention", spy)  # what ops resolved the library to
    layer = Attention(num_heads=4, head_dim=8, num_kv_heads=2, layer_idx=0, scale=0.35)
    q = torch.randn(7, 32, device=device)
    k, v = torch.randn(7, 16, device=device), torch.randn(7, 16, device=device)
    metadata = AttentionMetadata(query_start_loc=[0, 3, 7], seq_lens=[3, 4], causal=False)
    with forward_context(metadata):
        out = layer(q, k, v)
    assert out.shape == (7, 32) and out.device.type == device
    assert spy.devices == (["cpu"] if device == "cpu" else [])  # meta: SDPA, never the kernel


def _scheduled(request_id: str, new: list[int], start: int, blocks: list[int]) -> ScheduledRequest:
    prompt = [1] * start + new
    return ScheduledRequest(
        request_id, new, start, blocks, prompt, [], None, None, None, None, True, True
    )


def test_step_tensors_and_plans_live_on_the_model_device() -> None:
    requests = [_scheduled("a", [5], 4, [0, 2]), _scheduled("b", [6, 7, 8], 0, [1])]
    kv = [torch.zeros(2, 2, 4, 4, 8, device="meta")]
    batch = build_input_batch(requests, 4, kv, device=torch.device("meta"))
    for tensor in (batch.input_ids, batch.positions, batch.attention.slot_mapping):
        assert tensor is not None and tensor.device.type == "meta"
    plan = paged_plan(batch.attention)
    assert plan.decode_tables is not None and plan.decode_tables.device.type == "meta"
    assert plan.decode_ends is not None and plan.decode_ends.device.type == "meta"
    assert plan.decode_padding.device.type == "meta"
    host = build_input_batch(requests, 4, [torch.zeros(2, 2, 4, 4, 8)])
    assert host.attention.slot_mapping is not None
    assert host.attention.slot_mapping.tolist() == [2 * 4 + 0, 4, 5, 6]


def test_host_tensors_travel_packed_end_to_end_and_come_back_as_views() -> None:
    parts = [torch.arange(5), torch.tensor([[7, 8], [9, 10]]), torch.empty(0, dtype=torch.long)]
    flat, sizes = pack(parts)
    assert flat.tolist() == [0, 1, 2, 3, 4, 7, 8, 9, 10] and sizes == [5, 4, 0]
    back = unpack(flat, sizes, parts)
    assert [b.shape for b in back] == [p.shape for p in parts]
    assert all(torch.equal(b, p) for b, p in zip(back, parts, strict=True))
    assert back[1].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    host = to_device(parts, torch.device("cpu"))
    assert all(h is p for h, p in zip(host, parts, strict=True))  # the host copies nothing


def test_structured_outputs_mask_on_a_device_matches_the_host_one() -> None:
    vocab = 75  # two whole words and a partial one, plus ids past the bitmask when W = 2
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=generator)
    words = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32, generator=generator)
    words[1] = 0  # a row that refuses every token
    for width in (3, 2):
        expected, got = logits.clone(), logits.clone()
        kept_numpy = numpy_mask_allowed(expected, [2, 0], words[:, :width])
        with ops.use_torch():  # the torch ops a device's logits take
            kept_torch = mask_allowed(got, [2, 0], words[:, :width])
        assert kept_torch == kept_numpy == [True, False]
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


# ---- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_minilm_on_cuda_in_its_default_dtype_matches_sentence_transformers(
    st_embeddings: torch.Tensor,
) -> None:
    from cenote import LLM

    llm = LLM(device="cuda")
    model_config = llm.engine.config.model
    assert model_config.device == "cuda" and model_config.dtype == torch.bfloat16
    assert all(p.device.type == "cuda" for p in llm.engine.model.parameters())
    outputs = llm.embed(PARITY_TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    ours = torch.tensor([o.outputs.embedding for o in outputs])
    cosine = F.cosine_similarity(ours, st_embeddings.cpu(), dim=-1)
    assert cosine.min().item() >= 0.999


@pytest.mark.gpu
def test_tiny_llama_greedy_on_cuda_keeps_its_kv_cache_there(tmp_path: Path) -> None:
    from cenote import LLM, SamplingParams

    make_decoder(tmp_path, "llama")
    llm = LLM(str(tmp_path), device="cuda", dtype="float32")
    assert all(kv.device.type == "cuda" for kv in llm.engine.runner.kv_caches or [])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.gpu
def test_tiny_llama_kv_cache_on_cuda_fills_gpu_memory_utilization(tmp_path: Path) -> None:
    """The weights and one step of a tiny model take well under 2 GiB: the cache is the rest
    of the fraction asked for."""
    from cenote import LLM, SamplingParams

    make_decoder(tmp_path, "llama")
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", gpu_memory_utilization=0.1)
    manager = llm.engine.kv_cache_manager
    assert manager is not None
    block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, fp32
    cache = manager.num_blocks * block
    budget = 0.1 * torch.cuda.get_device_properties(0).total_memory
    assert budget - 2 * GiB < cache < budget
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.gpu
def test_host_tensors_reach_cuda_in_one_pinned_copy() -> None:
    parts = [torch.arange(5), torch.tensor([[7, 8], [9, 10]])]
    moved = to_device(parts, torch.device("cuda"))
    assert all(m.device.type == "cuda" for m in moved)
    assert [m.cpu().tolist() for m in moved] == [p.tolist() for p in parts]
    assert moved[0].untyped_storage().data_ptr() == moved[1].untyped_storage().data_ptr()


@pytest.mark.gpu
def test_tiny_llama_decode_graphs_equal_eager_on_cuda(tmp_path: Path) -> None:
    from cenote import LLM, SamplingParams

    make_decoder(tmp_path, "llama")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    results = []
    for eager in (True, False):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", enforce_eager=eager)
        assert (llm.engine.runner.decode_graphs is None) == eager
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            [(o.outputs[0].token_ids, [sorted(s.items()) for s in o.outputs[0].logprobs])
             for o in outputs]
        )  # fmt: skip
    assert results[0] == results[1]  # two streams: a captured size, bit for bit
