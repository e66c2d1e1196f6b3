#!/bin/bash
# Session 23. STAGE=a (a fresh machine; carry .device/wheels .device/tok): #58's generator test, diagnosed. At std
# 0.02 (W0's init) the hybrid generator's log-probs against the trainer's and both against a float64 CPU forward
# (`benchmarks/check_hybrid_generator.py`, three paths); then tests/test_qwen3_5_gpu.py, each test under a limit (its
# generator test now holds each side against the float64 forward).
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
case ${STAGE:-a} in
a)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  timeout 90 python3 benchmarks/check_hybrid_generator.py --std 0.02 --variants few \
    --out $OUT/check_hybrid_generator_std0.02.json > $OUT/check_std0.02.log 2>&1
  echo "check_hybrid_generator std 0.02 rc $?"; grep -E "^(bfloat16|float32)|Error" $OUT/check_std0.02.log | cut -c1-250
  timeout ${TLIMIT:-330} python3 -m pytest -v -p no:cacheprovider --tb=short --timeout 100 -m gpu tests/test_qwen3_5_gpu.py \
    > $OUT/qwen3_5_gpu_tests.log 2>&1
  echo "qwen3_5 GPU tests: rc $?"
  grep -E "PASSED|FAILED|ERROR|passed|failed|^E  .*(max|Mismatch|Greatest|against float64)" $OUT/qwen3_5_gpu_tests.log | \
    sed 's/^tests\///' | cut -c1-300 | head -30;;
esac
