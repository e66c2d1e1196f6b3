#!/bin/bash
# For the next session (carry .device/wheels .device/tok on a fresh machine): what session 17 left unrun on a GPU.
# #57: the mode's gradients on Gemma 3 270M / Qwen3-0.6B shapes against the default mode's (the Gemma preset learned
# slower in the mode than TRL) and the masters-as-bf16 check on CUDA; #58: the hybrid generator test and the invariant-mode hybrid step.
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=line -m gpu tests/test_mode_gradients_gpu.py \
  tests/test_offset_rmsnorm_gpu.py tests/test_mode_master_rounding.py 2>&1 | tail -6
GLIMIT=${GLIMIT:-220} TLIMIT=1 bash scripts/gpu_pending_e.sh 2>&1 | grep -E "hybrid test|PASSED|FAILED|^E" | tail -6
d=/tmp/step_hybrid_bi; rm -rf $d
timeout ${RLIMIT:-200} python3 -m monorl.cli train --preset qwen3_0_6b_sum_digits --model.shape qwen3_5-0.8b \
  --model.random_init true --rollout.ignore_eos true --checkpoint.final false --checkpoint.every_minutes 0 \
  --steps 4 --batch_invariant true --run_dir $d > $OUT/step_hybrid_bi.log 2>&1
echo "qwen3_5-0.8b invariant rc $?"; grep -E "^step|Error|error:" $OUT/step_hybrid_bi.log | cut -c1-170 | tail -4
