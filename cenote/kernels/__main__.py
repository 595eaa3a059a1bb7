"""``python -m cenote.kernels``: build (or find cached) both C++ extensions for this CPU now, so
that the first ``cenote serve`` or ``LLM(...)`` does not spend its start-up compiling them
(scripts/serve.sh runs it once at set-up); ``CENOTE_KERNEL_ARCH`` picks the variant. Exits 1 where a build fails (plain torch is used
then, as at run time)."""

from __future__ import annotations

import logging
import sys
import time


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from cenote.kernels import kernel_arch, kernel_cache_dir, quant_ops
    from cenote.models.layers.attention_kernels import attention_ops

    start = time.perf_counter()
    built = {"quantized matmul / fused layers": quant_ops(), "attention": attention_ops()}
    for name, ops in built.items():
        print(f"{name}: {'ready' if ops is not None else 'unavailable (plain torch)'}")
    print(
        f"arch: {kernel_arch()}; cache: {kernel_cache_dir()} ({time.perf_counter() - start:.1f} s)"
    )
    return 0 if all(ops is not None for ops in built.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
