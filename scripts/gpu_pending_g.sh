#!/bin/bash
# Session 16's last call (carry .device/wheels .device/tok on a fresh machine): #58's RL step after the trace and
# plan fixes (Qwen3.5-0.8B against Qwen3-0.6B, default and invariant mode, one machine), then the blind fixes' tests
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
RLIMIT=${RLIMIT:-110} STEPS=${STEPS:-6} SECTIONS=rl timeout ${FLIMIT:-330} bash scripts/gpu_pending_f.sh 2>&1 \
  | grep -E "^qwen|Error|error:" | head -12
export PYTHONPATH=$PWD/src:$PWD/.device/site
# #62: W0's shape in the mode with the invariant GEMM's K parts on for o and down (the 40-row timing's picks) against
# off (the runs above), the trainer walking the same parts; logprob_diff_max must stay 0.0
d=/tmp/step_parts; rm -rf $d
timeout 70 python3 - $d > $OUT/step_parts.log 2>&1 <<'PY'
import sys
from monorl.cli import main
from monorl.ops.tunables import overridden
with overridden({"matmul_split.parts": ((2048, 4), (3072, 4))}):
    main(["train", "--preset", "qwen3_0_6b_sum_digits", "--model.shape", "qwen3-0.6b", "--model.random_init", "true",
          "--rollout.ignore_eos", "true", "--checkpoint.final", "false", "--checkpoint.every_minutes", "0",
          "--steps", "6", "--batch_invariant", "true", "--run_dir", sys.argv[1]])
PY
python3 -c "import json,sys; s=json.load(open('$d/summary.json')); print('qwen3-0.6b invariant, parts (2048,4),(3072,4): steady step %.4f s generate %.2f train %.2f logprob_diff_max %s' % (s['steady_step_s'], s['generate_s'], s['train_s'], s.get('logprob_diff_max')))" || tail -3 $OUT/step_parts.log
# the blind fixes' GPU tests: gpu_pending_e's, without its slow hybrid generator test
GLIMIT=0 bash scripts/gpu_pending_e.sh
