#!/usr/bin/env bash
# Every GPU check and benchmark of monorl in one call (see the device notes in benchmarks/RESULTS.md):
#   tests:   all GPU tests (pytest -m gpu)
#   trainer: the trainer-graph GPU tests, then benchmarks/profile_train_step.py (eager / graphs / compiled)
#   profile: benchmarks/profile_train_step.py only
#   loop:    the RL-loop table (benchmarks/bench_rl_loop.py, one fresh process per column)
# Usage on the device: bash scripts/gpu_check.sh [tests|trainer|profile|loop|all]   (logs and JSON under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/monorl_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log --oneline -1 2>/dev/null || true
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $what == trainer ]]; then
  python3 -m pytest -q -m gpu tests/test_trainer_graphs_gpu.py tests/test_fused_weights.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests_trainer.log" | tail -25
fi
if [[ $what == trainer || $what == profile || $what == all ]]; then
  python3 benchmarks/profile_train_step.py --out "$OUT/train_step.json" 2>&1 | tee "$OUT/profile_train.log" \
    | grep -v DEBUG | tail -45
fi
if [[ $what == loop || $what == all ]]; then
  python3 benchmarks/bench_rl_loop.py --out "$OUT/rl_loop.json" 2>&1 | tee "$OUT/rl_loop.log"
fi
