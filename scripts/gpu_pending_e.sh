#!/bin/bash
# Session 16's first call (carry .device/wheels .device/tok .device/gguf.sha256 on a fresh machine): the GPU tests
# of session 15's blind fixes (the conv step without FMA contraction, window recycling in the mode after
# sequence_of_rows, GPT-OSS's CUDA forward with pinned routes) and the hybrid generator test; limits TLIMIT, GLIMIT (0: skip it)
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
Q=tests/test_qwen3_5_gpu.py
timeout ${TLIMIT:-200} python3 -m pytest -v -p no:cacheprovider --tb=short --durations=8 -m "gpu or not gpu" -s \
  $Q::test_decode_kernels_equal_the_gathered_reference_in_bf16 \
  tests/test_sinks_gpu.py::test_cuda_forward_matches_cpu_fp32 tests/test_window_recycling_gpu.py \
  > $OUT/tests.log 2>&1
echo "pytest rc $?"
grep -E "PASSED|FAILED|ERROR|passed|failed|s call |kernel / reference" $OUT/tests.log | sed 's/^tests\///' | cut -c1-220 | head -30
grep -E "^E  " $OUT/tests.log | head -16
[ "${GLIMIT:-220}" = 0 ] && exit 0  # GLIMIT=0: without the hybrid generator test
timeout ${GLIMIT:-220} python3 -m pytest -v -p no:cacheprovider --tb=short --durations=3 -m "gpu or not gpu" \
  $Q::test_hybrid_generator_equals_the_trainer_forward_on_cuda > $OUT/hybrid_test.log 2>&1; echo "hybrid test rc $?"
grep -E "PASSED|FAILED|passed|failed|s call |^E  " $OUT/hybrid_test.log | cut -c1-200 | head -12
