#!/bin/bash
# Session 20. One machine, calls in this order (each carries what it names; the machine keeps ignored paths):
# STAGE=a (carry .device/wheels .device/tok .device/tri/parts.sha256 .device/tri/parts/a): #57 on this device --
#   Gemma 3's fused layers' GPU tests, the key splits, the window decode's profile and benchmark with the window
#   layers' 2-way key split (never timed in the step). STAGE=a2 (no carry): at 128 and 256 rows, and the 1B shape.
# STAGE=b (carry .device/tri/parts/b): #58 -- Triton 3.7.1 (fla's requirement for its gated backward on Hopper, fla
#   #640) joined into .device/tri371 and put first on the path; tests/test_qwen3_5_gpu.py with fla and the decode
#   kernels on; then W0's workload on qwen3_5-0.8b against qwen3-0.6b, default mode, fla on, under Triton 3.7.1.
# STAGE=g PART=a..e (carry .device/gemma3/gguf.sha256 with a, then .device/gemma3/parts/PART): the Gemma GGUF;
#   the call with the last part also runs STAGE=vs (gpu_pending_l.sh) with SEEDS="0 0": a warm second run.
# STAGE=c, then STAGE=d: causal_conv's taps (#58) against the tree before (.device/old/src: `git archive <rev> src`),
#   W0's hybrid step under Triton 3.6 (c) and 3.7.1 (d); c also times the vision step (images ahead, in the
#   trainer's after_update) and profiles the window decode at 256 rows.
# Next (session 21): session 20's device time ran out inside STAGE=c, after the window tests and the 256-row profile.
#   Left: the hybrid's two trees (c's last lines), VISION=1 (the vision step with images made in after_update), and
#   STAGE=d (Triton 3.7.1: the two trees with fla's backward, and a profile of the hybrid's RL step).
set -u
source scripts/gpu_common.sh  # the device's setup; step, FLA_ON, tri
case ${STAGE:-a} in
a)
  tri
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  TOP=20 STAGE=fused bash scripts/gpu_pending_l.sh 2>&1 | grep -vE "^torch |^export|^total|^-rw|^drwx" | tail -60;;
a2)
  # more rows (the KV's share of the step grows, the kernels' fixed latency does not), and the 1B shape
  bw=3.13e12; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && bw=4.6e12
  (cd benchmarks && timeout 150 python3 profile_window_decode.py --shape gemma3-270m --context 16384 --rows 128 \
    --top 12 --bandwidth $bw --out $OUT/profile_window_decode_128.json 2>&1 | grep -v USDT | tail -40)
  for c in "gemma3-270m 128,256 128_256" "gemma3-1b 64 64"; do set -- $c
    (cd benchmarks && timeout 150 python3 bench_window_decode.py --shapes $1 --rows $2 --contexts 16384 \
      --budget-s 110 --out $OUT/window_decode_$1_$3.json 2>&1 | grep -v USDT | grep -E "^\{|^\||Error" | cut -c1-400)
  done;;
b)
  tri || exit 1
  export STEPS=${STEPS:-8} RLIMIT=${RLIMIT:-120}  # this stage's step defaults, as before the helpers moved
  T=$PWD/.device/tri371
  PYTHONPATH=$T:$PYTHONPATH python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
  PYTHONPATH=$T:$PYTHONPATH timeout 200 python3 -m pytest -v -p no:cacheprovider --tb=short -m gpu \
    tests/test_qwen3_5_gpu.py > $OUT/qwen3_5_tests_371.log 2>&1
  echo "qwen3_5 GPU tests, triton 3.7.1: rc $?"
  grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/qwen3_5_tests_371.log | sed 's/^tests\///' | cut -c1-150 | tail -12
  grep -E "^E  " $OUT/qwen3_5_tests_371.log | head -12
  PYTHONPATH=$T:$PYTHONPATH step hybrid_fla_tri371 qwen3_5-0.8b "$FLA_ON"
  PYTHONPATH=$T:$PYTHONPATH step dense_tri371 qwen3-0.6b ""
  [ "${ONLY371:-0}" = 1 ] && exit 0
  step hybrid_fla_fwd_tri360 qwen3_5-0.8b "$FLA_ON"
  step dense_tri360 qwen3-0.6b "";;
c)  # carry .device/wheels .device/tok .device/old (the tree before causal_conv's taps) .device/tri/parts.sha256 .device/tri/parts/a
  tri
  timeout 80 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu tests/test_gemma3_fused_gpu.py \
    tests/test_offset_rmsnorm_gpu.py tests/test_window_recycling_gpu.py tests/test_attention_window_gpu.py \
    > $OUT/window_gpu_tests.log 2>&1
  echo "window GPU tests rc $?"; grep -E "passed|failed|^FAILED|^E  " $OUT/window_gpu_tests.log | head -8
  bw=3.13e12; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && bw=4.6e12
  (cd benchmarks && timeout 60 python3 profile_window_decode.py --shape gemma3-270m --context 16384 --rows 256 \
    --top 8 --bandwidth $bw --out $OUT/profile_window_decode_256.json 2>&1 | grep -v USDT | grep -E "floor|Error" | head -4)
  export STEPS=${STEPS:-3} RLIMIT=80
  PYTHONPATH=$PWD/.device/old/src:$PWD/.device/site step hybrid_old_tri360 qwen3_5-0.8b "$FLA_ON"
  step hybrid_new_tri360 qwen3_5-0.8b "$FLA_ON"
  [ "${VISION:-0}" = 1 ] || exit 0
  timeout 100 python3 benchmarks/bench_vision_step.py --trainer-graphs --out $OUT/vision_step.json > $OUT/vision.log 2>&1
  echo "vision step rc $?"; grep -v DEBUG $OUT/vision.log | tail -5;;
d)  # carry .device/tri/parts/b: the same two trees with fla's backward under Triton 3.7.1
  tri || exit 1
  export STEPS=${STEPS:-5} RLIMIT=${RLIMIT:-120} T=$PWD/.device/tri371
  PYTHONPATH=$T:$PWD/.device/old/src:$PWD/.device/site step hybrid_old_tri371 qwen3_5-0.8b "$FLA_ON"
  PYTHONPATH=$T:$PYTHONPATH step hybrid_new_tri371 qwen3_5-0.8b "$FLA_ON"
  # where the hybrid's 0.83 s of training goes (session 20: 1.24 s a step against Qwen3-0.6B's 0.41 s)
  PYTHONPATH=$T:$PYTHONPATH timeout 200 python3 benchmarks/profile_rl_step.py --set model.shape=qwen3_5-0.8b \
    --steps 3 --profile 1 --out $OUT/hybrid_rl_step.json 2>&1 | grep -v DEBUG | tail -50;;
g)
  bash scripts/device_setup.sh gemma3 2>&1 | grep -E "wait|OK|damaged"
  [ -f .device/model/gemma-3-270m-q4_k_m.gguf ] && STAGE=vs SEEDS="${SEEDS:-0 0}" bash scripts/gpu_pending_l.sh;;
esac
# STAGE=v (no carry): #59 -- the vision step with trainer graphs, images encoded ahead (a run's encode_ahead) and
#   not (--no-ahead: how sessions 13-16 timed it), one machine
[ "${STAGE:-a}" = v ] && for a in "" "--no-ahead"; do
  timeout 170 python3 benchmarks/bench_vision_step.py --trainer-graphs $a --out $OUT/vision_step${a:+_noahead}.json \
    > $OUT/vision${a:+_noahead}.log 2>&1
  echo "vision step ${a:-ahead} rc $?"; grep -v DEBUG $OUT/vision${a:+_noahead}.log | tail -6
done
