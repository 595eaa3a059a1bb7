"""C++ kernels compiled at first use for this machine's CPU, cached on disk.

``quant_ops()`` returns the compiled module: weight-only quantized matmuls (quant_linear.cpp) and
fused decoder-layer steps (fused_ops.cpp), or
None where it cannot be built (no C++ compiler, ``CENOTE_DISABLE_KERNELS=1``): callers then fall
back to dense weights, and say so in one log line. The build takes about a minute once; its
result lives under ``$CENOTE_CACHE_DIR`` (default ``~/.cache/cenote``) in a folder named by the
source's hash and the CPU's vector features, so a machine with other features builds its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from functools import cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("quant_linear.cpp", "fused_ops.cpp")]
# CPU features that change what -march=native generates for these loops
_FEATURE_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
_lock = threading.Lock()


def cache_dir() -> Path:
    """cenote's on-disk cache (compiled kernels): ``$CENOTE_CACHE_DIR`` or ``~/.cache/cenote``."""
    root = os.environ.get("CENOTE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cenote"


def cpu_features() -> tuple[str, ...]:
    """The vector features in ``/proc/cpuinfo`` that matter to the kernels' code generation."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return tuple(flag for flag in _FEATURE_FLAGS if flag in flags)
    except OSError:
        pass
    return ()


def _build_name() -> str:
    import torch

    key = "|".join(
        [
            *(source.read_text(encoding="utf-8") for source in _SOURCES),
            torch.__version__,
            platform.machine(),
            ",".join(cpu_features()),
        ]
    )
    return "cenote_quant_" + hashlib.sha256(key.encode()).hexdigest()[:16]


@cache
def _load() -> ModuleType | None:
    if os.environ.get("CENOTE_DISABLE_KERNELS") == "1":
        logger.info("C++ kernels disabled by CENOTE_DISABLE_KERNELS=1")
        return None
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        logger.warning("no C++ kernels for %s; quantized weights run dense", platform.machine())
        return None
    try:
        from torch.utils.cpp_extension import load

        name = _build_name()
        build_dir = cache_dir() / "kernels" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
        return load(
            name=name,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: fall back, say why
        logger.warning(
            "quantized-matmul kernel unavailable (%s: %s); weights run dense",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None


def quant_ops() -> ModuleType | None:
    """The compiled quantized-matmul module, building it on first call; None if unavailable."""
    with _lock:
        return _load()
