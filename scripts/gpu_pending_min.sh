#!/bin/bash
# The least of gpu_pending_a.sh, for a call with little device time left: the GPU tests of the CUDA code written
# after session 13's GPU calls (GPT-OSS sinks, Qwen3.5 decode kernels + fla, windows, the frozen forwards' graphs)
set -u
export PYTHONUNBUFFERED=1
tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${LIMIT:-170} python3 -m pytest -v -p no:cacheprovider tests/test_sinks_gpu.py tests/test_qwen3_5_gpu.py tests/test_window_recycling_gpu.py "tests/test_trainer_graphs_gpu.py::test_a_graph_replayed_teacher_forward_equals_the_eager_one" "tests/test_trainer_graphs_gpu.py::test_the_kl_reference_and_the_teacher_replay_graphs_of_their_own" tests/test_attention_window_gpu.py -m "gpu or not gpu" > $OUT/gpu_tests.log 2>&1
grep -E "PASSED|FAILED|ERROR|XFAIL|XPASS|passed|failed" $OUT/gpu_tests.log | grep -v "^E " | sed 's/^tests\///' | cut -c1-140 | tail -60
grep -E "^E  " $OUT/gpu_tests.log | head -12
