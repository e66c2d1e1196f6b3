#!/bin/bash
# Session 21. STAGE=v (carry .device/wheels .device/tok): #59 -- the vision step (images encoded in the trainer's
#   after_update, session 20's change, never timed) with one profiled training step per case, to see where the
#   image step's extra ~0.14 s of training goes.
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case ${STAGE:-v} in
v)
  timeout ${VLIMIT:-300} python3 benchmarks/bench_vision_step.py --trainer-graphs --profile ${TOP:-22} \
    ${CASES:+--cases $CASES} --out $OUT/vision_step_profiled.json > $OUT/vision_profiled.log 2>&1
  echo "vision step rc $?"; grep -v DEBUG $OUT/vision_profiled.log | grep -vE "^  step" | tail -90;;
esac
