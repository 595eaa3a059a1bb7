"""Applying structured outputs' token bitmasks: the C++ kernel (``apply_token_bitmask_``)
against the numpy path, on 16 rows of SmolLM2's 49,152 tokens with dense mixed masks (as
inside a JSON string). Prints the CPU and the median of 50 passes each.

    flock /tmp/cpu_bench.lock python benchmarks/mask_apply.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from cenote.kernels import cpu_features, cpu_model
from cenote.sampling.sampler import mask_allowed, numpy_mask_allowed


def main() -> None:
    print(f"CPU: {cpu_model()}; features: {' '.join(cpu_features())}")
    rng = np.random.default_rng(0)
    vocab, rows = 49152, 16
    words = rng.integers(-(2**31), 2**31, size=(rows, vocab // 32), dtype=np.int64)
    bits = torch.from_numpy(words.astype(np.int32))
    bits[:, ::7] = -1  # some blocks allowed whole
    source = torch.randn(rows, vocab)
    for name, mask in (("numpy", numpy_mask_allowed), ("kernel", mask_allowed)):
        times = []
        for _ in range(50):
            logits = source.clone()
            start = time.perf_counter()
            mask(logits, list(range(rows)), bits)
            times.append(time.perf_counter() - start)
        print(f"{name}: {np.median(times) * 1e3:.3f} ms for {rows} rows of {vocab}")


if __name__ == "__main__":
    main()
