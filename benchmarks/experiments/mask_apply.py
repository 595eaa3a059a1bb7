"""Applying structured outputs' token bitmasks: the C++ kernel (``apply_token_bitmask_``)
against the numpy path, on 16 rows of SmolLM2's 49,152 tokens with dense mixed masks (as
inside a JSON string). Prints the CPU and the median of 50 passes each.

    flock /tmp/cpu_bench.lock python -m benchmarks.experiments.mask_apply
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.common import cpu_banner, median_seconds
from cenote.sampling.sampler import mask_allowed, numpy_mask_allowed


def main() -> None:
    print(cpu_banner())
    rng = np.random.default_rng(0)
    vocab, rows = 49152, 16
    words = rng.integers(-(2**31), 2**31, size=(rows, vocab // 32), dtype=np.int64)
    bits = torch.from_numpy(words.astype(np.int32))
    bits[:, ::7] = -1  # some blocks allowed whole
    source = torch.randn(rows, vocab)
    for name, mask in (("numpy", numpy_mask_allowed), ("kernel", mask_allowed)):
        logits = source.clone()  # masking it again does the same work: the same rows go to -inf
        seconds = median_seconds(lambda m=mask, x=logits: m(x, list(range(rows)), bits), runs=50)
        print(f"{name}: {seconds * 1e3:.3f} ms for {rows} rows of {vocab}")


if __name__ == "__main__":
    main()
