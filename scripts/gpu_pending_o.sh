#!/bin/bash
# Session 22. One machine, calls in this order (each carries what it names; the machine keeps ignored paths):
# STAGE=a (carry .device/wheels .device/tok .device/tri/parts.sha256 .device/tri/parts/a):
#   #62: W0 on the fresh machine, then twice warm; the process wall split by the summary's mtime (the run's own
#   wall_s ends when summary.json is written): before the run's clock / the run / after the summary; imports timed.
#   #59: the vision step at the default micro-batch budget (8,192) and at 32,768 (one micro-batch a step), the
#   first with its training step and a 1-token batch (prefill, the tower's forward) profiled.
# STAGE=b (carry .device/tri/parts/b): #58 under Triton 3.7.1 with fla on: the hybrid generator test alone (why it
#   failed in session 20, the whole traceback in $OUT), then the hybrid's RL step profiled.
# STAGE=c (a fresh machine; carry as STAGE=a): #58's GPU tests under the device's Triton (3.6): the generator
#   test's three variants (bf16 fla + kernels, bf16 plain paths, fp32 fla + kernels) and fla's packed conv.
# STAGE=e (a fresh machine; carry .device/wheels .device/tok): c's tests, then W0's step under Triton 3.6 (fla's
#   forward and the packed conv; the rule's backward the reference, fla #640's guard) against Qwen3-0.6B.
# STAGE=d (carry .device/tri/parts/b): #58 under Triton 3.7.1: W0's step, hybrid (fla: the rule, its backward, the
#   packed conv, shared bounds) against Qwen3-0.6B, default mode; with PROFILE=1 the hybrid's step profiled too.
# Next (session 23): session 22 ran a and b (and b's fixes by hand); no machine was granted after its changes.
#   Left: c (or e) on a fresh machine carrying .device/tri/parts.sha256 .device/tri/parts/a too, then d.
set -u
source scripts/gpu_common.sh  # the device's setup; step, FLA_ON, tri, w0_runs
case ${STAGE:-a} in
a)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 - > $OUT/imports.txt 2>&1 <<'PY'
import time
t = time.perf_counter(); import torch; a = time.perf_counter() - t  # noqa: E401,E702
torch.zeros(1, device="cuda"); b = time.perf_counter() - t - a  # noqa: E702
t = time.perf_counter(); import monorl.cli; c = time.perf_counter() - t  # noqa: E401,E702
t = time.perf_counter(); import triton; d = time.perf_counter() - t  # noqa: E401,E702
print(f"import torch {a:.2f} s, CUDA init {b:.2f} s, import monorl.cli after torch {c:.2f} s, triton after {d:.2f} s")
PY
  cat $OUT/imports.txt
  w0_runs
  for mbt in 8192 32768; do
    prof=""; [ $mbt = 8192 ] && prof="--profile 14 --profile-prefill 14"
    timeout 170 python3 benchmarks/bench_vision_step.py --trainer-graphs --micro-batch-tokens $mbt $prof \
      --out $OUT/vision_step_mbt$mbt.json > $OUT/vision_mbt$mbt.log 2>&1
    echo "micro_batch_tokens $mbt rc $?"; grep -v DEBUG $OUT/vision_mbt$mbt.log | grep -vE "^  step|^    " | tail -9
  done;;
b)
  tri || exit 1
  T=$PWD/.device/tri371
  PYTHONPATH=$T:$PYTHONPATH python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  PYTHONPATH=$T:$PYTHONPATH timeout ${TLIMIT:-240} python3 -m pytest -v -x -p no:cacheprovider --tb=long -m gpu \
    tests/test_qwen3_5_gpu.py -k hybrid_generator > $OUT/hybrid_generator_test.log 2>&1
  echo "hybrid generator test, triton 3.7.1, fla on: rc $?"
  grep -E "PASSED|FAILED|passed|failed|^E  " $OUT/hybrid_generator_test.log | cut -c1-200 | head -24
  PYTHONPATH=$T:$PYTHONPATH timeout 300 python3 benchmarks/profile_rl_step.py --set model.shape=qwen3_5-0.8b \
    --steps 3 --profile 1 --out $OUT/hybrid_rl_step.json > $OUT/hybrid_rl_step.log 2>&1
  echo "hybrid RL step profile rc $?"; grep -v DEBUG $OUT/hybrid_rl_step.log | tail -60;;
c)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  timeout ${TLIMIT:-240} python3 -m pytest -v -p no:cacheprovider --tb=short -m gpu tests/test_qwen3_5_gpu.py \
    > $OUT/qwen3_5_gpu_tests_360.log 2>&1
  echo "qwen3_5 GPU tests, triton 3.6: rc $?"
  grep -E "PASSED|FAILED|ERROR|passed|failed|^E  .*(max|Mismatch|Greatest)" $OUT/qwen3_5_gpu_tests_360.log | \
    sed 's/^tests\///' | cut -c1-330 | head -24;;
d)
  tri || exit 1
  export PYTHONPATH=$PWD/.device/tri371:$PYTHONPATH
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  export STEPS=${STEPS:-5} RLIMIT=${RLIMIT:-120}
  step hybrid_fla_371 qwen3_5-0.8b "$FLA_ON"
  step dense_371 qwen3-0.6b ""
  [ "${PROFILE:-0}" = 1 ] || exit 0
  timeout 200 python3 benchmarks/profile_rl_step.py --set model.shape=qwen3_5-0.8b batch_invariant=false \
    --steps 3 --profile 1 --kernels 30 --out $OUT/hybrid_rl_step.json > $OUT/hybrid_rl_step.log 2>&1
  echo "hybrid RL step profile rc $?"; grep -v DEBUG $OUT/hybrid_rl_step.log | grep -vE "^\| |^host pieces" | \
    tail -68 | cut -c1-160;;
e)
  STAGE=c bash scripts/gpu_pending_o.sh 2>&1 | grep -v "^torch "
  export STEPS=${STEPS:-4} RLIMIT=${RLIMIT:-100}
  step hybrid_fla_360 qwen3_5-0.8b "$FLA_ON"
  step dense_360 qwen3-0.6b "";;
esac
