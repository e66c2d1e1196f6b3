#!/bin/bash
# Session 19. #57: every seed of the Gemma-3-270M preset to 100 steps now that stop_without_signal lets a converged
# run go on, and where the window decode's step goes.
# STAGE=part (the first call carries .device/wheels .device/tok .device/gemma3/gguf.sha256 .device/gemma3/parts/a
#   and also runs STAGE=prof; later calls carry the next part, b..e).
# STAGE=prof: the device's read bandwidth (contiguous stream) and the window decode's profile at 16k x 64 rows,
#   attention launch by launch (no GGUF needed).
# STAGE=vs SEEDS="0 1 2": bench_vs_trl.py's monorl side per seed (the JSONs go to $OUT).
# STAGE=fused (the first call of a machine: carry .device/wheels): Gemma 3's fused generator layers -- their GPU
#   tests, the window/full key splits, the window decode's profile and benchmark (random init, no GGUF).
# Next (session 20): STAGE=fused again on an H100, to measure the window layers' 2-way key split
#   (`attention.window_split_keys`, set from tune_window_splits.py on an H200, not yet timed in the step); then
#   STAGE=vs SEEDS="0 0" for a warm run (the kept kernel list no longer keyed by the seed).
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
profile() {
  (cd benchmarks && timeout 200 python3 profile_window_decode.py --shape gemma3-270m --context 16384 --rows 64 \
    --top ${TOP:-40} --bandwidth 3.13e12 ${PROFILE_ARGS:-} --out $OUT/profile_window_decode.json 2>&1 | grep -v USDT | tail -110)
}
prof() {
  export PYTHONPATH=$PWD/src:$PWD/.device/site
  (cd benchmarks && timeout 120 python3 probe_read_bandwidth.py --shapes 64/16384 --out $OUT/read_bw.json 2>&1 \
    | tail -40)
  PROFILE_ARGS=--triton-gemm profile
}
case ${STAGE:-part} in
part)
  bash scripts/device_setup.sh 2>&1 | tail -1
  bash scripts/device_setup.sh gemma3 2>&1 | grep -E "wait|OK|damaged"
  [ "${PROF:-0}" = 1 ] && prof;;
prof) prof;;
fused)
  bash scripts/device_setup.sh 2>&1 | tail -1
  export PYTHONPATH=$PWD/src:$PWD/.device/site
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider --tb=short -m gpu tests/test_gemma3_fused_gpu.py \
    tests/test_offset_rmsnorm_gpu.py tests/test_window_recycling_gpu.py tests/test_attention_window_gpu.py 2>&1 \
    | grep -vE "^\s*$" | tail -25
  (cd benchmarks && timeout 120 python3 tune_window_splits.py --out $OUT/tune_window_splits.json 2>&1 | tail -12)
  PROFILE_ARGS=--triton-gemm profile
  (cd benchmarks && timeout 150 python3 bench_window_decode.py --shapes gemma3-270m --rows 64 \
    --contexts 4096,16384 --budget-s 120 --out $OUT/window_decode.json 2>&1 | grep -v USDT | tail -30);;
vs)
  bash scripts/device_setup.sh gemma3 2>&1 | grep -E "wait|OK|damaged"
  export PYTHONPATH=$PWD/src:$PWD/.device/site
  for s in ${SEEDS:-0 1 2}; do
    timeout ${VLIMIT:-170} python3 benchmarks/bench_vs_trl.py --preset gemma3_270m_arith --seed $s \
      --model .device/model/gemma-3-270m-q4_k_m.gguf --sides monorl --out $OUT/vs_monorl_s$s.json \
      > $OUT/monorl_s$s.log 2>&1
    echo "seed $s rc $?"; grep -vE "^step|it/s|s/it" $OUT/monorl_s$s.log | tail -6
  done
  tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls *.log) && rm -f $OUT/*.log;;
esac
