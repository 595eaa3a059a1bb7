"""Every instruction-set variant of the C++ kernels, built and checked on any x86-64 machine.

A native build compiles only this CPU's ``#if`` branches, so on an AVX-512 machine the AVX2 and
scalar code (what AVX2-only CPUs run) would never be compiled or tested. Each variant here is
built with ``CENOTE_KERNEL_ARCH`` in a subprocess (its library registers the same torch
namespace as the native build's) and runs a representative subset of the kernel tests: every
op family (quantized row kernels for 4 and 8 bits with fp32 and with 8-bit activations,
dequantize, norms, SiLU-and-mul, rotary, argmax, token bitmask, varlen and paged attention, the
decode stack, the segmented LoRA update, each op's torch fallback against its kernel) and, for
AVX2, SmolLM2's GGUF end to end. The builds live in the suite's own kernel cache, so only a run
after a kernel source changed pays for them (65-93 s a variant on 2 shared cores, 18-22 s once
built; docs/performance.md).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cenote import kernels
from cenote.kernels import (
    KERNEL_ARCHES,
    attention_ops,
    build_or_none,
    extension_name,
    kernel_arch,
    kernels_disabled,
    quant_ops,
)

_ROOT = Path(__file__).resolve().parents[2]
# the vector extensions each variant's build must report (compiled_isa)
VARIANTS = {"x86-64-v3": ["avx2", "f16c", "fma"], "x86-64": []}
# the kernel tests a variant runs (node ids under tests/kernels/)
CHECKS = [
    "test_quant.py::test_gguf_tensors_convert_exactly",
    "test_quant.py::test_quant_linear_matches_dense_matmul",
    "test_quant.py::test_quant_linear_bf16_activations",
    "test_quant.py::test_fused_kernel_takes_bf16_rows_and_rounds_once",
    "test_quant.py::test_row_results_do_not_depend_on_the_batch",
    "test_quant.py::test_fused_projection_of_mixed_formats",
    "test_quant.py::test_dense_copy_serves_steps_of_many_rows",
    "test_quant.py::test_bad_kernel_arguments_raise_clearly",
    "test_quant_rows.py",
    "test_quant_q8.py",
    "test_fused_ops.py",
    "test_kernel_ops.py",
    "test_attention.py::test_varlen_kernel_bf16_head_sizes",
    "test_attention.py::test_varlen_kernel_runs_micro_kernels_where_bf16_is_native",
    "test_attention.py::test_varlen_kernel_bf16_peaked_scores",
    "test_attention.py::test_varlen_kernel_bf16_alibi",
    "test_attention.py::test_encoder_batch_matches_per_request_attention",
    "test_attention.py::test_decode_matches_reference",
    "test_attention.py::test_paged_kernel_head_sizes",
    "test_attention.py::test_paged_kernel_rejects_bad_input",
    "test_decode_stack.py::test_stack_equals_python_loop[int8-float32-llama]",
    "test_decode_stack.py::test_stack_equals_python_loop[none-bfloat16-qwen2_sliding]",
    "test_decode_stack.py::test_stack_with_adapters_equals_python_loop[int8-float32]",
    "test_decode_stack.py::test_stack_with_adapters_equals_python_loop[none-bfloat16]",
    "test_lora_kernel.py",
    "test_kernel_variants.py::test_this_build_took_its_own_branches",
]
# AVX2 is what most machines without AVX-512 run: SmolLM2's GGUF end to end as well (5 s)
EXTRA_CHECKS = {"x86-64-v3": ["test_quant.py::test_smollm2_quantized_greedy_equals_dense"]}


def _runs_here(arch: str) -> str | None:
    """Why ``arch`` cannot be built and run on this machine, or None."""
    if kernels_disabled():
        return "kernels disabled by CENOTE_DISABLE_KERNELS=1"
    previous = os.environ.get("CENOTE_KERNEL_ARCH")
    os.environ["CENOTE_KERNEL_ARCH"] = arch
    try:
        kernel_arch()
    except ValueError as e:
        return str(e)
    finally:
        if previous is None:
            del os.environ["CENOTE_KERNEL_ARCH"]
        else:
            os.environ["CENOTE_KERNEL_ARCH"] = previous
    return None


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_variant_passes_the_kernel_tests(arch: str) -> None:
    """The variant builds (a failed build fails here: inside the subprocess the kernel tests
    would only skip) and passes the kernel tests; its results are the native build's within the
    same tolerances, against the same references."""
    reason = _runs_here(arch)
    if reason is not None:
        pytest.skip(reason)
    env = dict(os.environ, CENOTE_KERNEL_ARCH=arch, PYTHONPATH=str(_ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x"]
        + [f"tests/kernels/{check}" for check in CHECKS + EXTRA_CHECKS.get(arch, [])],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary


def test_this_build_took_its_own_branches() -> None:
    """Inside a variant's subprocess: both extensions built, for that arch's vector extensions
    and no others (no AVX-512 branch slipped in; no bf16 dot products)."""
    arch = kernel_arch()
    if arch == "native":
        pytest.skip("runs inside a variant's subprocess (test_variant_passes_the_kernel_tests)")
    ops = quant_ops()
    assert ops is not None, "the kernel library did not build for " + arch
    assert attention_ops() is not None, "the attention ops are missing from the " + arch + " build"
    assert sorted(ops.compiled_isa()) == VARIANTS[arch]
    assert not ops.quant_dot_supported()


def test_unknown_arch_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CENOTE_KERNEL_ARCH", "avx9")
    with pytest.raises(ValueError, match="'avx9' is not one of native, x86-64-v3, x86-64"):
        kernel_arch()


def test_an_arch_the_cpu_lacks_falls_back_with_a_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Kernels for instructions this CPU does not have would die on the first call: the build
    is refused, with the missing features named, and plain torch runs."""
    monkeypatch.setattr(kernels.build, "_cpu_flags", lambda: {"sse2", "avx"})
    monkeypatch.setattr(kernels.build.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("CENOTE_KERNEL_ARCH", "x86-64-v3")
    with caplog.at_level(logging.WARNING, logger="cenote.kernels.build"):
        built = build_or_none(
            lambda: kernels.build.build_extension("probe", [], python_module=False),
            "probe",
            "torch",
        )
    assert built is None
    assert "needs CPU features this CPU lacks: avx2, fma, f16c, bmi2, movbe" in caplog.text


def test_variants_have_their_own_cache_folders(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arch is part of the build's identity, so variants sit side by side in the cache; a
    non-native build does not depend on which CPU made it."""
    sources = [Path(kernels.__file__).parent / "csrc" / "fused_ops.cpp"]
    names = {arch: extension_name("k", sources, [], arch, "2.0") for arch in KERNEL_ARCHES}
    assert len(set(names.values())) == len(KERNEL_ARCHES)
    assert names["x86-64-v3"].startswith("k_x86_64_v3_") and names["native"].startswith("k_")
    monkeypatch.setattr(kernels.build, "cpu_identity", lambda: "model name: another CPU")
    assert extension_name("k", sources, [], "x86-64", "2.0") == names["x86-64"]
    assert extension_name("k", sources, [], "native", "2.0") != names["native"]


def test_ops_are_resolved_once_per_process() -> None:
    """``quant_ops()`` hands out one object whose ops are looked up once: a lookup per call
    (a new object each time) cost 12 % of one-stream decode (docs/performance.md)."""
    ops = quant_ops()
    if ops is None:
        pytest.skip("the kernel library did not build here")
    assert quant_ops() is ops
    assert ops.argmax_rows is quant_ops().argmax_rows  # cached on the object, not looked up again
    assert "argmax_rows" in vars(ops)
