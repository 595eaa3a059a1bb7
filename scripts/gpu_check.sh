#!/usr/bin/env bash
# cenote on a CUDA GPU, one command (about 2 minutes on an H200 before CUDA graphs,
# docs/performance.md): the table of benchmarks/gpu_check.py (environment, MiniLM parity and
# throughput vs sentence-transformers, tiny Llama greedy vs transformers, CUDA graphs vs eager,
# decode throughput with and without graphs vs transformers), then the parity tests with
# CENOTE_TEST_DEVICE=cuda.
# Exits non-zero when any of them fails. OUT (optional): a folder for the table and the logs.
set -u -o pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# the CPU kernels are never called with CUDA tensors: skip their one-minute build
export CENOTE_DISABLE_KERNELS=1
out="${OUT:-$(mktemp -d)}"
status=0
python3 -m benchmarks.gpu_check --out "$out/gpu_table.md" 2>&1 | tee "$out/gpu_check.log" || status=1
CENOTE_TEST_DEVICE=cuda CENOTE_ALLOW_MISSING_WEIGHTS=1 timeout 240 python3 -m pytest -q \
  -p no:cacheprovider -k "not smollm2" \
  tests/engine/test_platform.py tests/kernels/test_triton_attention.py tests/models/test_embed_parity.py \
  tests/models/test_generate_parity.py \
  2>&1 | tee "$out/gpu_tests.log" || status=1
echo "gpu_check: $([ $status = 0 ] && echo PASSED || echo FAILED) (table: $out/gpu_table.md)"
exit $status
