#!/bin/bash
# W0 (the reference workload) on this tree and on .base (the session's start, 4cbe682), in turns: process wall and
# steady step from summary.json. On the device, carry .models (the Qwen3-0.6B config + tokenizer), .base (`git
# archive REV src`) and the wheels installed in /tmp/site: bash scripts/w0_ab.sh
set -u
export PYTHONUNBUFFERED=1
M=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from bench_memory import model_dir; print(model_dir(Path('.models'), 'qwen3-0.6b'))")
ARGS="--preset qwen3_0_6b_sum_digits --model.path $M --model.random_init true --rollout.ignore_eos true --checkpoint.final false --checkpoint.every_minutes 0"
for i in 1 2 3; do
  for side in new base; do
    src=$PWD/src; [ $side = base ] && src=$PWD/.base/src
    d=/tmp/w0_${side}_$i; rm -rf $d
    t0=$(date +%s.%N)
    PYTHONPATH=$src:/tmp/site python3 -m monorl.cli train $ARGS --run_dir $d > $OUT/w0_${side}_$i.log 2>&1
    rc=$?
    t1=$(date +%s.%N)
    python3 - "$d" "$side" "$i" "$rc" "$t0" "$t1" <<'PY'
import json, sys
d, side, i, rc, t0, t1 = sys.argv[1:]
try:
    s = json.load(open(f"{d}/summary.json"))
    print(f"{side} run {i}: rc {rc} process wall {float(t1)-float(t0):.2f} s, startup {s['startup_s']:.2f} s, steady step {s['steady_step_s']:.4f} s, logprob_diff_max {s['logprob_diff_max']}")
except Exception as e:
    print(f"{side} run {i}: rc {rc} no summary ({e})")
PY
  done
done
