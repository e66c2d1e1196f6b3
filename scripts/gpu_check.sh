#!/usr/bin/env bash
# monorl's GPU checks and benchmarks as a few named suites (docs/development.md), run on a GPU machine from the
# repository root; logs and JSON go to $OUT (default /tmp/monorl_out):
#   tests: all GPU tests (pytest -m gpu)
#   bench: the reference generator batch and its decode step (benchmarks/bench_generate.py), the generator's
#          throughput (bench_throughput.py --no-compile) and the RL-loop row of the preset as users run it
#          (bench_rl_loop.py --columns preset_auto; the real configs and tokenizer from .models, carried)
#   wall:  the reference preset's process wall time as a user's machine sees it (Python's bytecode cache and the
#          compile caches kept across runs): WALL_RUNS runs (default 3: the first cold) for each of WALL_BACKENDS
#          (default "auto"; "auto inductor" also times it compiled)
#   scale: benchmarks/bench_scale.py on every GPU of the machine (2, 4 or 8) and on one of them, the same rows
#   all:   tests, then bench (the default)
# Any other mode (the investigations benchmarks/RESULTS.md quotes: ab, cold, kept, decode_step, scale_compile, ...)
# runs from scripts/gpu_lab.sh, unchanged.
# Usage on the device: bash scripts/gpu_check.sh [tests|bench|wall|scale|all|LAB_MODE]
set -uo pipefail
what=${1:-all}
case $what in
  tests|bench|wall|scale|all) ;;
  *) exec bash "$(dirname "$0")/gpu_lab.sh" "$@" ;;
esac
OUT=${OUT:-/tmp/monorl_out}; mkdir -p "$OUT"
# wheels the device lacks (jsonargparse) go first: .whl carried, installed to /tmp/site (device README)
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log --oneline -1 2>/dev/null || true

if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi

if [[ $what == bench || $what == all ]]; then
  python3 benchmarks/bench_generate.py --out "$OUT/generate.json" 2>&1 | tee "$OUT/generate.log" | grep -v DEBUG \
    | tail -12
  python3 benchmarks/bench_throughput.py --no-compile --out "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" \
    | grep -v DEBUG | tail -6
  python3 benchmarks/bench_rl_loop.py --model-dir .models --columns preset_auto --out "$OUT/rl_loop.json" 2>&1 \
    | tee "$OUT/rl_loop.log" | grep -v DEBUG | tail -22
fi

if [[ $what == wall ]]; then
  # the reference workload as #18 times it: the preset, Qwen3-0.6B's config with random weights, EOS ignored
  d=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from bench_memory import model_dir
print(model_dir(Path('.models'), 'qwen3-0.6b'))")
  args="--preset qwen3_0_6b_sum_digits --model.path $d --model.random_init true --rollout.ignore_eos true
        --checkpoint.final false --checkpoint.every_minutes 0 --compile.cache_dir /tmp/cc_wall"
  # Python writes its bytecode cache as on a user's machine (the device image sets PYTHONDONTWRITEBYTECODE)
  unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc TRITON_CACHE_DIR=/tmp/tc_wall
  rm -rf /tmp/cc_wall /tmp/tc_wall
  rows=""
  for backend in ${WALL_BACKENDS:-auto}; do
    for run in $(seq 1 "${WALL_RUNS:-3}"); do
      t0=$(date +%s.%N)
      python3 -m monorl.cli train $args --compile.backend "$backend" --run_dir "/tmp/wall_${backend}_$run" \
        > "$OUT/wall_${backend}_$run.log" 2>&1
      t1=$(date +%s.%N)
      rows+=$(python3 - "/tmp/wall_${backend}_$run" "$backend, run $run" "$t0" "$t1" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
wall = float(sys.argv[4]) - float(sys.argv[3])
print(f"| {sys.argv[2]} | {wall:.2f} | {s['wall_s']:.2f} | {s['startup_s']:.2f} | {s['steady_step_s']:.3f} |")
PY
)$'\n'
    done
  done
  printf "\n| run | process wall s | run wall s | startup s | steady step s |\n|---|---|---|---|---|\n%s" "$rows"
fi

if [[ $what == scale ]]; then
  nvidia-smi topo -m 2>&1 | head -6; env | grep -E "NVLS|MULTICAST" || true
  n=$(python3 -c "import torch; print(torch.cuda.device_count())")
  python3 benchmarks/bench_scale.py --nproc "$n" --rows 8b,weak,ref8 --out "$OUT/scale_$n.json" 2>&1 \
    | tee "$OUT/scale_$n.log" | grep -E "^\||failed|Error|error" | tail -20
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_scale.py --nproc 1 --rows weak,ref8,8b --out "$OUT/scale_1.json" 2>&1 \
    | tee "$OUT/scale_1.log" | grep -E "^\||failed|Error|error" | tail -20
fi
