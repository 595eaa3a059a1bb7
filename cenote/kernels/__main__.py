"""``python -m cenote.kernels``: build (or find cached) the C++ kernel library for this CPU now,
so that the first ``cenote serve`` or ``LLM(...)`` does not spend its start-up compiling it
(scripts/serve.sh runs it once at set-up); ``CENOTE_KERNEL_ARCH`` picks the variant. Exits 1
where the build fails (every op runs its torch fallback then, as at run time)."""

from __future__ import annotations

import logging
import sys
import time


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from cenote.kernels import attention_ops, kernel_arch, kernel_cache_dir, quant_ops

    start = time.perf_counter()
    built = {"quantized matmul / fused layers": quant_ops(), "attention": attention_ops()}
    for name, library in built.items():
        print(f"{name}: {'ready' if library is not None else 'unavailable (plain torch)'}")
    print(
        f"arch: {kernel_arch()}; cache: {kernel_cache_dir()} ({time.perf_counter() - start:.1f} s)"
    )
    return 0 if all(library is not None for library in built.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
