#!/bin/bash
# Session 23. STAGE=a (a fresh machine; carry .device/wheels .device/tok): #58's generator test, diagnosed:
# tests/test_qwen3_5_gpu.py, each test under a limit (its generator test now holds each side against a float64 CPU
# forward); then W0's workload on Qwen3.5-0.8B in batch-invariant mode (logprob_diff 0 each step, the step's cost).
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
source scripts/gpu_common.sh  # step
case ${STAGE:-a} in
a)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  timeout ${TLIMIT:-200} python3 -m pytest -v -p no:cacheprovider --tb=short --timeout 100 -m gpu tests/test_qwen3_5_gpu.py \
    -k "${TESTS:-as_exact or packed_causal_conv or rule_gradients}" \
    > $OUT/qwen3_5_gpu_tests.log 2>&1
  echo "qwen3_5 GPU tests: rc $?"
  grep -E "PASSED|FAILED|ERROR|passed|failed|^E  .*(max|Mismatch|Greatest|against float64)" $OUT/qwen3_5_gpu_tests.log | \
    sed 's/^tests\///' | cut -c1-300 | head -30
  # the bitwise mode on the hybrid, W0's workload (session 17's run did not finish in 110 s)
  BI=true STEPS=3 RLIMIT=${RLIMIT:-130} step hybrid_bitwise qwen3_5-0.8b ""
  grep -E "step [0-9]+/" $OUT/step_hybrid_bitwise.log | cut -c1-200
  STEPS=3 RLIMIT=${DLIMIT:-75} step hybrid_default qwen3_5-0.8b ""  # the default mode's step beside it (fla was off by default then)
  grep -E "step [0-9]+/" $OUT/step_hybrid_default.log | cut -c1-200;;
esac
