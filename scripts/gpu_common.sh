#!/bin/bash
# Helpers the device scripts (scripts/gpu_pending_*.sh) source: `step` (one W0-workload CLI run of a model shape),
# `FLA_ON`, `tri` (Triton 3.7.1 joined from its two carried parts), `tests` (GPU tests, a log each) and `w0_runs`
# (W0 three times, each process wall split by summary.json's mtime). Sourcing it first sets the machine up (the
# carried wheels installed, the models' config and tokenizer files unpacked, PYTHONPATH); the helpers expect $OUT.
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
# one CLI run, W0's workload: name, shape, then python lines run before main (flags); BI=true: batch-invariant mode;
# EXTRA: more CLI arguments
step() {
  local name=$1 shape=$2 pre=$3 d=/tmp/step_$1; rm -rf $d
  local t0; t0=$(date +%s.%N)
  timeout ${RLIMIT:-150} python3 - $d $shape > $OUT/step_$name.log 2>&1 <<PY
import sys
$pre
from monorl.cli import main
main(["train", "--preset", "qwen3_0_6b_sum_digits", "--model.shape", sys.argv[2], "--model.random_init", "true",
      "--rollout.ignore_eos", "true", "--checkpoint.final", "false", "--checkpoint.every_minutes", "0",
      "--steps", "${STEPS:-6}", "--batch_invariant", "${BI:-false}", "--run_dir", sys.argv[1], *"${EXTRA:-}".split()])
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
# W0 (the reference workload, Qwen3-0.6B's released config) N times (default 3): each process wall split into
# before the run's clock, the run's own wall_s (it ends when summary.json is written) and after it
w0_runs() {
  local M i d t0 t1 rc
  M=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from bench_memory import model_dir; print(model_dir(Path('.models'), 'qwen3-0.6b'))")
  for i in $(seq 1 ${1:-3}); do
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
}
# W0 N times (default 2) with the batch-invariant GEMM's K parts ((2048, 4), (3072, 4): o and down) and without,
# alternating in one machine: steady step and logprob_diff_max of each
w0_parts() {
  local M i P d
  M=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from bench_memory import model_dir; print(model_dir(Path('.models'), 'qwen3-0.6b'))")
  for i in $(seq 1 ${1:-2}); do for P in none parts; do
    d=/tmp/w0p_${P}_$i; rm -rf $d
    timeout 90 python3 - $M $d $P > $OUT/w0_${P}_$i.log 2>&1 <<'PY'
import sys
from monorl.cli import main
from monorl.ops.tunables import overridden
parts = {"matmul_split.parts": ((2048, 4), (3072, 4))} if sys.argv[3] == "parts" else {}
with overridden(parts):
  main(["train", "--preset", "qwen3_0_6b_sum_digits", "--model.path", sys.argv[1], "--model.random_init", "true",
        "--rollout.ignore_eos", "true", "--checkpoint.final", "false", "--checkpoint.every_minutes", "0",
        "--run_dir", sys.argv[2]])
PY
    python3 -c "import json,sys; s=json.load(open('$d/summary.json')); print('W0 $P $i: steady step %.4f s, generate %.3f train %.3f s (10 steps), logprob_diff_max %s' % (s['steady_step_s'], s['generate_s'], s['train_s'], s['logprob_diff_max']))" 2>/dev/null || echo "W0 $P $i: no summary"
  done; done
}
# GPU tests: name, pytest args...; the log in $OUT, the outcome lines here (TLIMIT: all of them, PTLIMIT: each)
tests() {
  local name=$1; shift
  timeout ${TLIMIT:-300} python3 -m pytest -v -p no:cacheprovider --tb=short --timeout ${PTLIMIT:-150} -m gpu "$@" \
    > $OUT/$name.log 2>&1
  echo "$name: rc $?"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  .*(max|Mismatch|Greatest|against float64|Error)" \
    $OUT/$name.log | sed 's/^tests\///' | cut -c1-300 | head -30
}
