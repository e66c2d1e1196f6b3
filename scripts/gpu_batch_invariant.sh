#!/usr/bin/env bash
# Batch-invariant mode on the GPU in one call: its GPU tests (eager, aot_eager, inductor; bitwise
# generator == trainer log-probs) and the cost benchmark (table last). Logs and JSON under $OUT.
# Usage on the device: bash scripts/gpu_batch_invariant.sh
set -uo pipefail
OUT=${OUT:-/tmp/monorl_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$OUT/../inductor_cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${TEST_TIMEOUT:-230} python3 -m pytest -q -rA -s -p no:cacheprovider tests/test_batch_invariant_gpu.py \
  2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASS|FAIL|ERROR|batch-invariant|default mode|passed|failed|Error|assert" | tail -40
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_batch_invariant.py --mm-tiles auto large --out "$OUT/bench_batch_invariant.json" \
  2>&1 | tee "$OUT/bench.log" | tail -14
