#!/bin/bash
# Session 13's unrun GPU call A (carry .device/wheels .device/gguf.sha256 .device/tok, see scripts/device_wheels.sh): GPU tests of the new CUDA code (sinks, fla + Gated DeltaNet decode kernels, windows), the vision
# RL step after its fixes, the hybrid decode at rows where the dense model fits 16k
set -u
export PYTHONUNBUFFERED=1
tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_sinks_gpu.py tests/test_qwen3_5_gpu.py tests/test_gated_delta_decode.py tests/test_window_recycling_gpu.py "tests/test_trainer_graphs_gpu.py::test_a_graph_replayed_teacher_forward_equals_the_eager_one" "tests/test_trainer_graphs_gpu.py::test_the_kl_reference_and_the_teacher_replay_graphs_of_their_own" tests/test_attention_window_gpu.py -m "gpu or not gpu" > $OUT/gpu_tests.log 2>&1
grep -E "PASSED|FAILED|ERROR|XFAIL|XPASS|passed|failed" $OUT/gpu_tests.log | grep -v "^E " | sed 's/^tests\///' | cut -c1-140 | tail -60
grep -E "^E  " $OUT/gpu_tests.log | head -12
[ "${HYBRID:-0}" = 1 ] && timeout 150 python3 benchmarks/bench_hybrid_decode.py --no-train --rows 16,64 --contexts 1024,16384 --plain-decode-too --chunks 6 --out $OUT/hybrid_decode.json > $OUT/hybrid.log 2>&1; grep -v DEBUG $OUT/hybrid.log | grep -v "^qwen3.* {" | tail -16
timeout 100 python3 benchmarks/bench_vision_step.py --out $OUT/vision_step.json > $OUT/vision.log 2>&1; grep -v DEBUG $OUT/vision.log | tail -9
