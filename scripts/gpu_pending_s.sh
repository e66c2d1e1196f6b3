#!/bin/bash
# Session 25. One machine, two calls in a row (it is released 30 s after a call):
# STAGE=a (a fresh machine; carry .device/wheels .device/tok .device/tri/parts.sha256 .device/tri/parts/a), Triton
#   3.6: #62's W0 twice (fresh, then warm), W0's step profiled with its Chrome trace (where the pack's 29 ms host
#   span of session 13 goes), #58's rule step's launch values swept (benchmarks/tune_rule_step.py), then its hybrid generator test's four cases and the decode kernels' test.
# STAGE=b (carry .device/tri/parts/b), Triton 3.7.1: as scripts/gpu_pending_r.sh's STAGE=b (the padded layout's
#   tests; the graphed hybrid's W0 step profiled).
set -u
source scripts/gpu_common.sh  # the device's setup; step, tri, tests, w0_runs
export PTLIMIT=200
case ${STAGE:-a} in
a)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  w0_runs 2
  timeout 120 python3 benchmarks/profile_rl_step.py --steps 4 --profile 1 --kernels 30 --out $OUT/w0_rl_step.json \
    --trace $OUT/w0_trace.json.gz > $OUT/w0_profile.log 2>&1
  echo "W0 profile rc $?"; grep -v DEBUG $OUT/w0_profile.log | grep -vE "^\| |^host pieces|^  " | tail -12 | cut -c1-400
  timeout 150 python3 benchmarks/tune_rule_step.py --rows 40,128 --stages 1,3 --out $OUT/tune_rule_step.json \
    2>&1 | grep -v DEBUG | tail -16
  TLIMIT=240 tests gpu_tests_360 tests/test_qwen3_5_gpu.py -k "as_exact or decode_kernels";;
b)
  STAGE=b bash scripts/gpu_pending_r.sh;;
c)  # never ran (no machine was lent after call a; scripts/gpu_pending_t.sh carries it on): a fresh machine, Triton 3.6
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  w0_runs 1  # trainer_init without fla's import (7.24 s warm, 10.70 s fresh in call a)
  # the hybrid generator's bf16 case failed in call a on a helper's unfinished gated-attention path; now finished
  TLIMIT=190 PTLIMIT=120 tests gpu_tests_c tests/test_gated_attention_kernel_gpu.py tests/test_qwen3_5_gpu.py \
    -k "not fla_ and not packed and not rule_grad and not dtype1 and not dtype2 and not dtype3"
  w0_parts 1;;
esac
