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
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
# one CLI run, W0's workload: name, shape, then python lines run before main (flags)
step() {
  local name=$1 shape=$2 pre=$3 d=/tmp/step_$1; rm -rf $d
  local t0; t0=$(date +%s.%N)
  timeout ${RLIMIT:-150} python3 - $d $shape > $OUT/step_$name.log 2>&1 <<PY
import sys
$pre
from monorl.cli import main
main(["train", "--preset", "qwen3_0_6b_sum_digits", "--model.shape", sys.argv[2], "--model.random_init", "true",
      "--rollout.ignore_eos", "true", "--checkpoint.final", "false", "--checkpoint.every_minutes", "0",
      "--steps", "${STEPS:-6}", "--batch_invariant", "false", "--run_dir", sys.argv[1]])
PY
  local rc=$? t1; t1=$(date +%s.%N)
  python3 - "$d" "$name" "$rc" "$t0" "$t1" <<'PY'
import json, sys
d, name, rc, t0, t1 = sys.argv[1:]
try:
    s = json.load(open(f"{d}/summary.json"))
    print(f"{name:22s} rc {rc} process {float(t1)-float(t0):6.2f} s startup {s['startup_s']:5.2f} s steady step "
          f"{s['steady_step_s']:.4f} s (generate {s['generate_s']:.2f} train {s['train_s']:.2f} s over all steps) "
          f"logprob_diff_max {s.get('logprob_diff_max')}")
except Exception as e:
    print(f"{name} rc {rc} no summary ({e})")
PY
  grep -E "gated delta rule:|Error|error:" $OUT/step_$name.log | grep -v DEBUG | sort -u | cut -c1-200 | tail -4
}
FLA_ON='from monorl.ops import gated_delta, gated_delta_decode
gated_delta.FLA_ENABLED = gated_delta_decode.ENABLED = True'
tri() {  # Triton 3.7.1, once both parts are here (its AMD backend left out: its entry point too)
  sed -i "/amd/d" .device/tri371/triton-3.7.1.dist-info/entry_points.txt 2>/dev/null
  [ -f .device/tri371/triton/__init__.py ] && return 0
  for p in a b; do [ -f .device/tri/parts/$p ] || { echo "triton waits for part $p"; return 1; }; done
  (cd .device/tri && sha256sum -c --quiet parts.sha256) || return 1
  mkdir -p .device/tri371 && cat .device/tri/parts/a .device/tri/parts/b | xz -d | tar x -C .device/tri371
  sed -i "/amd/d" .device/tri371/triton-3.7.1.dist-info/entry_points.txt
}
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
  M=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from bench_memory import model_dir; print(model_dir(Path('.models'), 'qwen3-0.6b'))")
  for i in 1 2 3; do
    d=/tmp/w0_$i; rm -rf $d; t0=$(date +%s.%N)
    timeout 120 python3 -m monorl.cli train --preset qwen3_0_6b_sum_digits --model.path $M --model.random_init true \
      --rollout.ignore_eos true --checkpoint.final false --checkpoint.every_minutes 0 --run_dir $d > $OUT/w0_$i.log 2>&1
    rc=$?; t1=$(date +%s.%N)
    cp $d/summary.json $OUT/w0_summary_$i.json 2>/dev/null
    python3 - "$d" "$i" "$rc" "$t0" "$t1" <<'PY'
import json, os, sys
d, i, rc, t0, t1 = sys.argv[1:]
t0, t1 = float(t0), float(t1)
try:
    s = json.load(open(f"{d}/summary.json"))
    m = os.stat(f"{d}/summary.json").st_mtime
    phases = " ".join(f"{k} {v:.2f}" for k, v in s.items() if k.endswith("_s") and isinstance(v, float))
    print(f"W0 run {i}: rc {rc} process wall {t1 - t0:.2f} s = before the run's clock {m - s['wall_s'] - t0:.2f} + "
          f"run wall_s {s['wall_s']:.2f} + after the summary {t1 - m:.2f}; steady step {s['steady_step_s']:.4f} s, "
          f"logprob_diff_max {s['logprob_diff_max']}\n   {phases}")
except Exception as e:
    print(f"W0 run {i}: rc {rc} no summary ({e})")
PY
  done
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
  PYTHONPATH=$T:$PYTHONPATH timeout 300 python3 benchmarks/profile_rl_step.py --set model.shape=qwen3_5-0.8b --fla \
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
  timeout 200 python3 benchmarks/profile_rl_step.py --set model.shape=qwen3_5-0.8b batch_invariant=false --fla \
    --steps 3 --profile 1 --kernels 30 --out $OUT/hybrid_rl_step.json > $OUT/hybrid_rl_step.log 2>&1
  echo "hybrid RL step profile rc $?"; grep -v DEBUG $OUT/hybrid_rl_step.log | grep -vE "^\| |^host pieces" | \
    tail -68 | cut -c1-160;;
e)
  STAGE=c bash scripts/gpu_pending_o.sh 2>&1 | grep -v "^torch "
  export STEPS=${STEPS:-4} RLIMIT=${RLIMIT:-100}
  step hybrid_fla_360 qwen3_5-0.8b "$FLA_ON"
  step dense_360 qwen3-0.6b "";;
esac
