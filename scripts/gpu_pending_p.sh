#!/bin/bash
# Session 23. STAGE=a (a fresh machine; carry .device/wheels .device/tok): #58's generator test, diagnosed. The hybrid
# generator's log-probs against the trainer's and both against a float64 CPU forward (which side drifted), each
# dtype and path, at the test's weights (std 0.2; six paths) and at std 0.05 and 0.02 (three) (`benchmarks/check_hybrid_generator.py`); then
# the GPU tests of tests/test_qwen3_5_gpu.py other than the generator's, each under a time limit.
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
case ${STAGE:-a} in
a)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  for std in 0.2 0.05 0.02; do v=few; [ $std = 0.2 ] && v=all
    lim=90; [ $std = 0.2 ] && lim=150
    timeout $lim python3 benchmarks/check_hybrid_generator.py --std $std --variants $v --out $OUT/check_hybrid_generator_std$std.json \
      > $OUT/check_std$std.log 2>&1
    echo "check_hybrid_generator std $std rc $?"; grep -E "^(bfloat16|float32)|Error" $OUT/check_std$std.log | cut -c1-250
  done
  timeout ${TLIMIT:-130} python3 -m pytest -v -p no:cacheprovider --tb=short --timeout 60 -m gpu tests/test_qwen3_5_gpu.py \
    -k "not hybrid_generator" > $OUT/qwen3_5_gpu_tests_rest.log 2>&1
  echo "the other qwen3_5 GPU tests: rc $?"
  grep -E "PASSED|FAILED|ERROR|passed|failed|^E  .*(max|Mismatch|Greatest)" $OUT/qwen3_5_gpu_tests_rest.log | \
    sed 's/^tests\///' | cut -c1-300 | head -24;;
esac
