#!/bin/bash
# #57 item 5: GPT-OSS-20B (released config, random init) LoRA RL steps on one GPU, the plan's rows beside the measured
# peak (bench_memory's gpt-oss-20b-lora row: the generator's adapters over the policy's shared base). After
# gpu_pending_a.sh on the same machine (it installed the wheels and restored .models).
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
timeout ${LIMIT:-200} python3 benchmarks/bench_memory.py --rows gpt-oss-20b-lora --steps 5 --out $OUT/mem_gpt_oss.json > $OUT/mem_gpt_oss.log 2>&1; echo "bench_memory rc $?"
grep -v DEBUG $OUT/mem_gpt_oss.log | tail -40
