#!/bin/bash
# Session 24. One machine, two calls in a row (the machine keeps ignored paths; it is released 30 s after a call):
# STAGE=a (a fresh machine; carry .device/wheels .device/tok .device/tri/parts.sha256 .device/tri/parts/a), Triton
#   3.6: session 23's pending STAGE=b of gpu_pending_p.sh (the hybrid generator test's four cases, fp32 now named,
#   and the decode kernels' test), the padded Gated DeltaNet's forward against the varlen one, then W0's step on
#   Qwen3.5-0.8B (fla's forward, the reference's backward: eager) and Qwen3-0.6B.
# STAGE=b (carry .device/tri/parts/b), Triton 3.7.1 (fla's backward serves): the padded layout's gradients and a
#   hybrid's graph-replayed trainer steps against eager ones; then W0's step on Qwen3.5-0.8B with trainer graphs
#   (the preset's default, now open to hybrids) and without, and Qwen3-0.6B beside them; PROFILE=1: the graphed
#   hybrid's step profiled.
set -u
source scripts/gpu_common.sh  # the device's setup; step, tri, tests
export PTLIMIT=150  # each test's limit (`tests`)
case ${STAGE:-a} in
a)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  tests gpu_tests_360 tests/test_qwen3_5_gpu.py -k "as_exact or decode_kernels" tests/test_gated_delta_padded_gpu.py
  export STEPS=${STEPS:-5}
  RLIMIT=150 step hybrid_360 qwen3_5-0.8b ""
  RLIMIT=90 step dense_360 qwen3-0.6b "";;
b)
  tri || exit 1
  export PYTHONPATH=$PWD/.device/tri371:$PYTHONPATH
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  TLIMIT=280 tests gpu_tests_371 tests/test_gated_delta_padded_gpu.py
  export STEPS=${STEPS:-6}
  RLIMIT=170 step hybrid_graphs_371 qwen3_5-0.8b ""
  grep -E "step [0-9]+/|graph" $OUT/step_hybrid_graphs_371.log | grep -v DEBUG | cut -c1-220 | tail -8
  EXTRA="--compile.trainer_cuda_graphs false" RLIMIT=100 step hybrid_eager_371 qwen3_5-0.8b ""
  RLIMIT=60 step dense_371 qwen3-0.6b ""
  [ "${PROFILE:-0}" = 1 ] || exit 0
  timeout 150 python3 benchmarks/profile_rl_step.py --set model.shape=qwen3_5-0.8b batch_invariant=false \
    --steps 3 --profile 1 --kernels 30 --out $OUT/hybrid_rl_step_graphs.json > $OUT/hybrid_rl_step.log 2>&1
  echo "hybrid RL step profile rc $?"; grep -v DEBUG $OUT/hybrid_rl_step.log | grep -vE "^\| |^host pieces" | \
    tail -40 | cut -c1-160;;
esac
