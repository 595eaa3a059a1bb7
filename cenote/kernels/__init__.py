"""cenote's C++ kernels: one torch library, ``torch.ops.cenote``, compiled at first use for this
machine's CPU and cached on disk.

- ``csrc/``: the sources (one file per op family, shared headers in ``csrc/include/``) and their
  one registration (``csrc/registration.cpp``);
- ``build.py``: build, cache and CPU identity (``CENOTE_KERNEL_ARCH`` picks the instruction set);
- ``library.py``: the loaded ops, typed (``quant_ops()``, ``attention_ops()``), for kernel tests
  and benchmarks;
- ``ops.py``: what layers call, one typed function per op that decides kernel or torch and holds
  the torch fallback (docs/kernels.md lists them).

Where a build fails (no C++ compiler, ``CENOTE_DISABLE_KERNELS=1``) every op runs its torch
fallback, with one log line saying why.
"""

from __future__ import annotations

from cenote.kernels.build import (
    KERNEL_ARCHES,
    build_extension,
    build_or_none,
    cpu_features,
    cpu_identity,
    cpu_model,
    extension_name,
    kernel_arch,
    kernel_cache_dir,
    kernel_library,
    kernels_disabled,
)
from cenote.kernels.library import (
    AttentionOps,
    DecodeStack,
    QuantOps,
    attention_ops,
    quant_ops,
)

__all__ = [
    "KERNEL_ARCHES",
    "AttentionOps",
    "DecodeStack",
    "QuantOps",
    "attention_ops",
    "build_extension",
    "build_or_none",
    "cpu_features",
    "cpu_identity",
    "cpu_model",
    "extension_name",
    "kernel_arch",
    "kernel_cache_dir",
    "kernel_library",
    "kernels_disabled",
    "quant_ops",
]
