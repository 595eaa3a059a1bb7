#!/bin/bash
# Runs the copied vLLM tests against `cenote serve` (under the shared CPU lock).
cd "$(dirname "$0")"
export PYTHONPATH=$PWD:$PWD/stubs HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec flock /tmp/cpu_bench.lock venv/bin/python -m pytest -q -rA "$@"
