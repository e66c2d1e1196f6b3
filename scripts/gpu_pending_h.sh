#!/bin/bash
# Session 17's first call (carry .device/wheels .device/tok, and the Gemma GGUF's first part with its sha256):
# #57's window decode step profiled (where a Gemma 3 270M step goes against its bytes floor), then gpu_pending_g
# (#58's hybrid RL step, #62's K parts in the RL step, the blind fixes' GPU tests)
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
bash scripts/device_setup.sh 2>&1 | tail -1
(cd benchmarks && PYTHONPATH=$PWD/../src:$PWD/../.device/site timeout ${PLIMIT:-120} python3 profile_window_decode.py \
  --shape gemma3-270m --context 16384 --rows 64 --out $OUT/profile_window_decode.json 2>&1 | grep -v USDT | tail -60)
bash scripts/gpu_pending_g.sh
