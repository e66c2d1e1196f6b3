#!/bin/bash
# Session 16's last call (carry .device/wheels .device/tok on a fresh machine): #58's RL step after the trace and
# plan fixes (Qwen3.5-0.8B against Qwen3-0.6B, default and invariant mode, one machine), then the blind fixes' tests
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
RLIMIT=${RLIMIT:-110} STEPS=${STEPS:-6} SECTIONS=rl timeout ${FLIMIT:-330} bash scripts/gpu_pending_f.sh 2>&1 \
  | grep -E "^qwen|Error|error:" | head -12
export PYTHONPATH=$PWD/src:$PWD/.device/site
Q=tests/test_qwen3_5_gpu.py
timeout ${TLIMIT:-150} python3 -m pytest -v -p no:cacheprovider --tb=short -m "gpu or not gpu" -s \
  $Q::test_decode_kernels_equal_the_gathered_reference_in_bf16 \
  tests/test_sinks_gpu.py::test_cuda_forward_matches_cpu_fp32 tests/test_window_recycling_gpu.py \
  > $OUT/tests.log 2>&1
echo "pytest rc $?"
grep -E "PASSED|FAILED|ERROR|passed|failed|kernel / reference" $OUT/tests.log | sed 's/^tests\///' | cut -c1-220 | head -20
grep -E "^E  " $OUT/tests.log | head -10
