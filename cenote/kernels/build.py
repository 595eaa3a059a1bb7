"""Build, cache and CPU identity of the C++ kernels: every source under ``csrc/`` compiled by
torch's extension tooling (``-O3 -march=<arch>``) into one torch library, ``torch.ops.cenote``,
cached under ``$CENOTE_CACHE_DIR/kernels`` in a folder named by the build's identity (sources,
their path, torch's version, flags, and for ``native`` the CPU's model and flags).

``CENOTE_KERNEL_ARCH`` picks the instruction set: ``native`` (this CPU), ``x86-64-v3`` (AVX2 +
FMA + F16C, the kernels' AVX2 branches) or ``x86-64`` (SSE2 only, their scalar branches).
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
from typing import TypeVar

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
