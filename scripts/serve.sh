#!/usr/bin/env bash
# Set up a fresh virtual environment and serve the embedded default model (all-MiniLM-L6-v2).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e .
HF_HUB_OFFLINE=1 exec .venv/bin/cenote serve "$@"
