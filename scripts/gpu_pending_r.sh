#!/bin/bash
# Next session (after session 24). One machine, two calls in a row (it is released 30 s after a call):
# STAGE=a (a fresh machine; carry .device/wheels .device/tok .device/tri/parts.sha256 .device/tri/parts/a), Triton
#   3.6: the hybrid generator test's four cases (session 24's fp32 cases failed at the test's graph assertion, fixed
#   since: an fp32 generator decodes eagerly) and the decode kernels' test.
# STAGE=b (carry .device/tri/parts/b), Triton 3.7.1: the padded layout's tests (the 0.8B heads' gradients did not
#   run in session 24), then the graphed hybrid's W0 step profiled beside Qwen3-0.6B's (where its remaining 1.74x
#   goes: generation ~0.35 s against 0.16 s). fla compiles and autotunes its kernels for minutes on a fresh machine:
#   the tests come first and warm its disk cache.
set -u
source scripts/gpu_common.sh  # the device's setup; step, tri, tests
export PTLIMIT=240  # each test's limit (`tests`)
case ${STAGE:-a} in
a)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  tests gpu_tests_360 tests/test_qwen3_5_gpu.py -k "as_exact or decode_kernels";;
b)
  tri || exit 1
  export PYTHONPATH=$PWD/.device/tri371:$PYTHONPATH
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  TLIMIT=330 tests gpu_tests_371 tests/test_gated_delta_padded_gpu.py
  STEPS=4 RLIMIT=200 step hybrid_graphs qwen3_5-0.8b ""  # fla's padded kernels compiled before the profile
  timeout 150 python3 benchmarks/profile_rl_step.py --set model.shape=qwen3_5-0.8b batch_invariant=false \
    --steps 3 --profile 1 --kernels 30 --out $OUT/hybrid_rl_step_graphs.json > $OUT/hybrid_profile.log 2>&1
  echo "hybrid RL step profile rc $?"; grep -v DEBUG $OUT/hybrid_profile.log | grep -vE "^\| |^host pieces" | \
    tail -40 | cut -c1-160;;
esac
