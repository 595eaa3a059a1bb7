"""C++ kernels compiled at first use for this machine's CPU, cached on disk.

One extension, every source under ``csrc/`` (one file per op family, shared headers in
``csrc/include/``), built by ``build_extension`` with torch's extension tooling (``-O3
-march=<arch>``; ``native`` by default, so a build is valid only on the CPU kind it was made on)
into one torch library, ``torch.ops.cenote`` (schemas and registrations: csrc/registration.cpp;
no source includes torch/extension.h, whose pybind11 and torch-python headers took 30 s of
compile time per file). Python reaches it as

- ``quant_ops()``: weight-only quantized matmuls, the fused decoder / encoder layer steps,
  w8a8 linears, the sampler's argmax, the decode stack and the segmented LoRA update;
- ``attention_ops()`` in cenote/models/layers/attention_kernels.py: paged and varlen attention.

Where a build fails (no C++ compiler, ``CENOTE_DISABLE_KERNELS=1``) the caller gets None and falls
back to plain torch, with one log line saying why. A build takes under a minute once; the result
lives under ``$CENOTE_CACHE_DIR/kernels`` (default ``~/.cache/cenote/kernels``) in a folder named
by a hash of the sources, their path, torch's version, the flags and (for ``native``) the CPU's
model and flags.

``CENOTE_KERNEL_ARCH`` picks the instruction set the kernels are compiled for: ``native`` (this
CPU), ``x86-64-v3`` (AVX2 + FMA + F16C, the kernels' AVX2 branches) or ``x86-64`` (SSE2 only,
their scalar branches). The arch is part of the build's identity, so the variants live side by
side in the cache; the tests build and run the non-native ones on any x86 machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = sorted((_HERE / "csrc").glob("*.cpp"))
_HEADERS = sorted((_HERE / "csrc" / "include").glob("*.h"))
# -ffp-contract=off: no fused multiply-adds the source does not ask for, so dequantized values
# and the fused elementwise ops round exactly as torch and gguf do
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# each arch's /proc/cpuinfo flags that its code needs (x86-64-v3 also needs bmi1, lzcnt and
# xsave, which every CPU with these has)
KERNEL_ARCHES: dict[str, tuple[str, ...]] = {
    "native": (),
    "x86-64-v3": ("avx2", "fma", "f16c", "bmi2", "movbe"),
    "x86-64": (),
}
_lock = threading.Lock()


class QuantOps(Protocol):
    """The functions of the quantized-matmul / fused-layer module that cenote calls (the
    ``cenote`` torch library: csrc/registration.cpp)."""

    def quant_matmul(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scale: torch.Tensor,
        mn: torch.Tensor | None,
        bits: int,
        group: int,
        /,
    ) -> torch.Tensor:
        """``x [M, K] @ dequant(q [N, K]).T`` -> ``[M, N]`` in ``x``'s dtype."""
        ...

    def quant_matmul_dot(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scale: torch.Tensor,
        mn: torch.Tensor | None,
        bits: int,
        group: int,
        /,
    ) -> torch.Tensor:
        """``x [M, K] bf16 @ dequant(q [N, K]).T`` -> bf16 ``[M, N]`` on AVX512-BF16 dot
        products, the weights as a dense bf16 copy holds them (groups of 32)."""
        ...

    def quant_matmul_q8(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scale: torch.Tensor,
        mn: torch.Tensor | None,
        bits: int,
        group: int,
        /,
    ) -> torch.Tensor:
        """``x [M <= 8, K] @ dequant(q [N, K]).T`` -> ``[M, N]`` in ``x``'s dtype (fp32 or
        bf16), each row of ``x`` quantized to int8 per block of 32 (GGUF Q8_0) and multiplied
        on integer dot products (AVX2 ``vpmaddubsw``, AVX512-VNNI ``vpdpbusd``); groups of 32."""
        ...

    def quant_dot_supported(self) -> bool:
        """Whether ``quant_matmul_dot`` runs on this CPU (AVX512-BF16)."""
        ...

    def compiled_isa(self) -> list[str]:
        """The vector extensions the build was compiled with (``avx2``, ``fma``, ``f16c``,
        ``avx512f``, ``avx512bw``, ``avx512vnni``, ``avx512bf16``): which ``#if`` branches of
        the kernels it runs."""
        ...

    def quant_dequantize(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        mn: torch.Tensor | None,
        bits: int,
        group: int,
        dtype: torch.dtype,
        buffer: torch.Tensor | None,
        /,
    ) -> torch.Tensor:
        """The dense ``[N, K]`` weight in ``dtype``, written into ``buffer`` when given."""
        ...

    def add_rms_norm_(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, /
    ) -> None:
        """``residual += x`` (when given), then ``x`` = RMSNorm of the sum (or of ``x``) times
        ``weight``, in place."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor, /) -> torch.Tensor:
        """``silu(gate) * up`` of a fused ``[T, 2 * intermediate]`` projection."""
        ...

    def rotary_(
        self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int, /
    ) -> None:
        """Rotate-half rotary embedding of the first ``width`` columns of ``qk``, in place."""
        ...

    def argmax_rows(self, x: torch.Tensor, /) -> torch.Tensor:
        """``x.argmax(-1)`` of fp32 rows ``[rows, n]`` (first maximum; a NaN counts as the
        maximum), int64 ``[rows]``."""
        ...

    def apply_token_bitmask_(
        self, logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor, /
    ) -> torch.Tensor:
        """``-inf`` on ``logits[rows[i], t]`` (fp32 ``[R, V]``, in place) where bit ``t % 32`` of
        ``words[i, t // 32]`` (int32 ``[k, W]``) is 0 or ``t >= 32 W``; bool ``[k]``: whether
        each row kept a finite logit."""
        ...

    def layer_norm_(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, /
    ) -> None:
        """LayerNorm of bf16 rows ``x [T, D]`` with bf16 ``weight`` and ``bias`` ``[D]``, in
        place (statistics and the affine step in fp32, one rounding)."""
        ...

    def add_layer_norm_(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        /,
    ) -> None:
        """``layer_norm_`` of ``x + residual`` (added in fp32, not rounded), written over ``x``."""
        ...

    def int8_supported(self) -> bool:
        """Whether the int8 micro-kernels (AMX-INT8, AVX512-VNNI) give the right product here
        (checked once)."""
        ...

    def int8_pack(self, weight: torch.Tensor, /) -> list[torch.Tensor]:
        """``weight [N, K]`` as int8 per output channel: [packed, scales fp32 [N],
        column sums int32 [N]] (int8_linear.cpp)."""
        ...

    def int8_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        col_sums: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        gelu: bool,
        /,
    ) -> torch.Tensor:
        """w8a8 ``x [M, K] @ w.T + bias`` of bf16 rows quantized per row, then GELU (erf) or
        ``+ residual``, rounded once to bf16 ``[M, N]``."""
        ...

    def lora_shrink_expand(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        a: list[torch.Tensor],
        b: list[torch.Tensor],
        row_starts: list[int],
        row_ends: list[int],
        col_starts: list[int],
        scales: list[float],
        /,
    ) -> None:
        """``out[r0:r1, c0:c0 + n] += scale * (x[r0:r1] @ a.T) @ b.T`` for every segment
        (``a [rank, K]``, ``b [n, rank]``, rows ``row_starts[s]:row_ends[s]``, first column
        ``col_starts[s]``), in place, in one call (lora.cpp); ``x`` / ``out`` fp32 or bf16, the
        factors fp32 or bf16, sums in fp32."""
        ...

    def DecodeStack(self, heads: int, kv_heads: int, head_dim: int, /) -> DecodeStack:  # noqa: N802
        """An empty stack of layers with these attention sizes (a torch custom class)."""
        ...


class DecodeStack(Protocol):
    """A llama-family decoder's layers with quantized weights, run as one C++ loop for decode
    steps (decode_stack.cpp): the ops of ``LlamaModel._forward_fused`` in the same order."""

    def add_linear(
        self,
        q: torch.Tensor | None,
        scale: torch.Tensor | None,
        mn: torch.Tensor | None,
        bits: int,
        group: int,
        fused_max_rows: int,
        dot_max_rows: int,
        packed: torch.Tensor | None,
        dense_dtype: torch.dtype,
        bias: torch.Tensor | None,
        /,
    ) -> None:
        """The next projection of the layer being built (qkv, o, gate_up, down): quantized
        (``q``... up to ``fused_max_rows`` rows; bf16 rows up to ``dot_max_rows`` on bf16 dot
        products), oneDNN-prepacked dense (``packed`` in ``dense_dtype``: more rows, or a dense
        layer), or both."""
        ...

    def add_layer(
        self,
        post_norm: torch.Tensor,
        post_eps: float,
        next_norm: torch.Tensor,
        next_eps: float,
        scale: float,
        cache_index: int,
        /,
    ) -> None:
        """Close the layer: its post-attention norm, the next input norm (or the final one),
        the attention scale and which KV cache of the step is its own."""
        ...

    def num_layers(self) -> int: ...

    def run(
        self,
        residual: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,
        tables: list[torch.Tensor],
        starts: list[torch.Tensor],
        ends: list[torch.Tensor],
        /,
    ) -> torch.Tensor:
        """Every layer over one-token rows: ``hidden`` is the first layer's normed input,
        ``residual`` its input (updated in place); returns the final norm's output."""
        ...


def kernel_cache_dir() -> Path:
    """Where built kernels live: ``$CENOTE_CACHE_DIR/kernels`` (default ~/.cache/cenote)."""
    root = os.environ.get("CENOTE_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cenote" / "kernels"


def cpu_identity() -> str:
    """The CPU model and flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or "unknown"."""
    for line in cpu_identity().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_features() -> tuple[str, ...]:
    """The vector features of this CPU that the kernels' code paths and the default dtype
    depend on (what a benchmark prints with its numbers)."""
    wanted = (
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
        "avx512_vnni",
        "amx_bf16",
        "amx_int8",
    )
    flags = _cpu_flags()
    return tuple(flag for flag in wanted if flag in flags)


def _cpu_flags() -> set[str]:
    for line in cpu_identity().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def kernel_arch() -> str:
    """The instruction set the kernels are compiled for: ``$CENOTE_KERNEL_ARCH`` (default
    ``native``). Raises ValueError for an unknown name, or for an arch whose instructions this
    CPU lacks (its kernels would die on an illegal instruction)."""
    arch = os.environ.get("CENOTE_KERNEL_ARCH", "native") or "native"
    if arch not in KERNEL_ARCHES:
        raise ValueError(f"CENOTE_KERNEL_ARCH={arch!r} is not one of {', '.join(KERNEL_ARCHES)}")
    if arch != "native" and platform.machine() != "x86_64":
        raise ValueError(
            f"CENOTE_KERNEL_ARCH={arch} is an x86-64 arch; this is {platform.machine()}"
        )
    missing = [flag for flag in KERNEL_ARCHES[arch] if flag not in _cpu_flags()]
    if missing:
        raise ValueError(
            f"CENOTE_KERNEL_ARCH={arch} needs CPU features this CPU lacks: {', '.join(missing)}"
        )
    return arch


def build_flags(arch: str) -> list[str]:
    """The compiler flags of a build for ``arch`` (one of ``KERNEL_ARCHES``)."""
    return [*_FLAGS, f"-march={arch}"]


def extension_name(
    prefix: str, sources: list[Path], headers: list[Path], arch: str, torch_version: str
) -> str:
    """The build's identity, as the extension's (and its cache folder's) name:
    ``prefix[_arch]_<hash>`` of the sources and headers, their path, torch's version, the flags
    and, for ``native`` alone, this CPU's model and flags."""
    identity = "\n".join(
        [
            *(path.read_text(encoding="utf-8") for path in [*sources, *headers]),
            *(str(source) for source in sources),  # two checkouts must not rebuild each other's
            torch_version,
            *build_flags(arch),
            cpu_identity() if arch == "native" else "",
        ]
    )
    variant = "" if arch == "native" else "_" + arch.replace("-", "_")
    return f"{prefix}{variant}_{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def build_extension(
    prefix: str, sources: list[Path], *, python_module: bool, headers: list[Path] | None = None
) -> ModuleType | None:
    """Build (or load the cached build of) ``sources`` for ``kernel_arch()`` as extension
    ``extension_name(...)`` (``headers``: the local headers they include, part of the hash).

    Raises what the build raises; returns the module (``python_module``) or None (a library of
    TORCH_LIBRARY ops, reached through ``torch.ops``)."""
    import torch
    from torch.utils.cpp_extension import load

    arch = kernel_arch()
    name = extension_name(prefix, sources, headers or [], arch, torch.__version__)
    build_dir = kernel_cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_turn(build_dir):
        module = load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=build_flags(arch),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=python_module,
            verbose=False,
        )
    return module if python_module else None


@contextlib.contextmanager
def _build_turn(build_dir: Path) -> Iterator[None]:
    """One process at a time builds or loads a kernel: an advisory lock (``flock``) the kernel
    releases when its holder exits, however it exits. torch's own build lock is a file that
    torch waits on forever, and a build killed midway (a server stopped while its core compiled)
    leaves it behind; holding our lock, no other cenote process is building here, so that file
    can only be such a leftover and is removed."""
    with open(build_dir / "turn.lock", "w", encoding="ascii") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)


def kernels_disabled() -> bool:
    return os.environ.get("CENOTE_DISABLE_KERNELS") == "1"


_T = TypeVar("_T")


def build_or_none(
    build: Callable[[], _T], what: str, fallback: str, log: logging.Logger = logger
) -> _T | None:
    """``build()``, or None (one line on ``log`` saying why: ``<what> unavailable (<the error's
    last line>); <fallback>``) where kernels are disabled or the build or load fails."""
    if kernels_disabled():
        log.info("%s disabled by CENOTE_DISABLE_KERNELS=1", what)
        return None
    try:
        return build()
    except Exception as e:  # no compiler, no ninja, a failed build: fall back, say why
        message = str(e).strip()
        log.warning(
            "%s unavailable (%s); %s",
            what,
            message.splitlines()[-1] if message else type(e).__name__,
            fallback,
        )
        return None


class _LibraryOps:
    """The ``cenote`` library's ops as attributes (``ops.quant_matmul(...)``), each resolved
    once to its overload so a call costs one dispatch (about 2 us, measured), and its
    ``DecodeStack`` class (``torch.classes.cenote.DecodeStack``)."""

    def __getattr__(self, name: str) -> object:
        import torch

        if name == "DecodeStack":
            found: object = torch.classes.cenote.DecodeStack
        else:
            try:
                found = getattr(torch.ops.cenote, name).default
            except (AttributeError, RuntimeError) as e:  # no such op in the library
                raise AttributeError(f"the cenote kernel library has no op {name!r}") from e
        setattr(self, name, found)
        return found


@cache
def _load_library() -> bool:
    def build() -> bool:
        build_extension("cenote_kernels", _SOURCES, python_module=False, headers=_HEADERS)
        return True

    built = build_or_none(
        build,
        "C++ kernels",
        "weights run dense, layers unfused, attention loops over requests in Python",
    )
    return built is True


_library_loaded: bool | None = None  # set once the first call has built or failed


def kernel_library() -> bool:
    """Whether the ``cenote`` torch library is loaded (built on first call, under a lock; later
    calls, one per kernel call on the hot path, read the answer without taking it)."""
    global _library_loaded
    if _library_loaded is None:
        with _lock:
            _library_loaded = _load_library()
    return _library_loaded


_OPS = _LibraryOps()  # one instance: each op is resolved once per process, not once per call


def quant_ops() -> QuantOps | None:
    """The quantized-matmul / fused-layer ops of the kernel library (built on first call);
    None if unavailable. torch.ops carry no static types: QuantOps declares the schemas."""
    return cast(QuantOps, _OPS) if kernel_library() else None
