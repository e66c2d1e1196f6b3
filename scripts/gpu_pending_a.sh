#!/bin/bash
# Session 13's unrun GPU call A (carry .device/wheels .device/gguf.sha256 .device/tok, see scripts/device_wheels.sh):
# the GPU tests of the new CUDA code (gpu_pending_min.sh), then the hybrid decode with the in-place kernels on and off
# (HYBRID=1), then the vision RL step after its fixes
set -u
export PYTHONUNBUFFERED=1
LIMIT=200 bash scripts/gpu_pending_min.sh
export PYTHONPATH=$PWD/src:$PWD/.device/site
[ "${HYBRID:-0}" = 1 ] && timeout 150 python3 benchmarks/bench_hybrid_decode.py --no-train --rows 16,64 --contexts 1024,16384 --plain-decode-too --chunks 6 --out $OUT/hybrid_decode.json > $OUT/hybrid.log 2>&1; grep -v DEBUG $OUT/hybrid.log | grep -v "^qwen3.* {" | tail -16
timeout 100 python3 benchmarks/bench_vision_step.py --out $OUT/vision_step.json > $OUT/vision.log 2>&1; grep -v DEBUG $OUT/vision.log | tail -9
