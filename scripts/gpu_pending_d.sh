#!/bin/bash
# Session 15's second call (carry .device/wheels .device/tok .device/gguf.sha256 on a fresh machine): the GPU tests
# gpu_pending_a's 200 s limit cut off, the GPT-OSS-20B LoRA steps after the grouped_mm and YaRN fixes, the vision RL
# step again (its image steps moved between two hosts), then the slow hybrid generator test
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
Q=tests/test_qwen3_5_gpu.py
timeout ${TLIMIT:-240} python3 -m pytest -v -p no:cacheprovider --tb=short --durations=10 -m "gpu or not gpu" \
  $Q::test_decode_kernels_equal_the_gathered_reference_in_bf16 \
  $Q::test_rule_gradients_equal_the_reference_where_rule_path_picks_fla_or_not \
  tests/test_sinks_gpu.py::test_cuda_forward_matches_cpu_fp32 tests/test_moe_gpu.py tests/test_attention_window_gpu.py \
  tests/test_window_recycling_gpu.py \
  "tests/test_trainer_graphs_gpu.py::test_a_graph_replayed_teacher_forward_equals_the_eager_one" \
  "tests/test_trainer_graphs_gpu.py::test_the_kl_reference_and_the_teacher_replay_graphs_of_their_own" \
  > $OUT/tests.log 2>&1
echo "pytest rc $?"
grep -E "PASSED|FAILED|ERROR|passed|failed|s call " $OUT/tests.log | sed 's/^tests\///' | cut -c1-150 | head -40
grep -E "^E  " $OUT/tests.log | head -16
LIMIT=${MLIMIT:-150} bash scripts/gpu_pending_c.sh 2>&1 | tail -5
[ -n "${SHORT:-}" ] && exit 0  # SHORT=1: without the vision step and the slow generator test
timeout 150 python3 benchmarks/bench_vision_step.py --out $OUT/vision_step.json > $OUT/vision.log 2>&1
grep -v DEBUG $OUT/vision.log | tail -8
# last: the hybrid generator test (fla's and the in-place kernels' gate; >100 s in session 15's first call: fla
# autotunes its chunk kernels at the first prefill, ~14 s in bench_hybrid_decode)
timeout ${GLIMIT:-200} python3 -m pytest -v -p no:cacheprovider --tb=short --durations=3 -m "gpu or not gpu" \
  $Q::test_hybrid_generator_equals_the_trainer_forward_on_cuda > $OUT/hybrid_test.log 2>&1; echo "hybrid test rc $?"
grep -E "PASSED|FAILED|passed|failed|s call |^E  " $OUT/hybrid_test.log | cut -c1-200 | head -12
