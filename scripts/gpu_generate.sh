#!/usr/bin/env bash
# GPU tests + generator benchmarks on a lent GPU. Usage: bash scripts/gpu_generate.sh
# PARTS (default "tests gen hf tp"): which parts to run. Results (JSON) go to $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src
OUT=${OUT:-/tmp/monorl_out}
mkdir -p "$OUT"
PARTS=${PARTS:-"tests gen hf tp"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has tests; then
  timeout 200 python3 -m pytest -q -m gpu tests/test_generate_gpu.py -p no:cacheprovider --tb=short 2>&1 \
    | grep -v -e DEBUG -e Warning -e warn | tail -30
fi
GEN_ARGS="--profile"
has hf && GEN_ARGS="$GEN_ARGS --hf"
if has gen; then
  timeout 300 python3 benchmarks/bench_generate.py --out "$OUT/bench_generate.json" $GEN_ARGS 2>&1 | tail -45
fi
if has tp; then
  timeout 300 python3 benchmarks/bench_throughput.py --out "$OUT/bench_throughput.json" 2>&1 | tail -12
fi
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print("\n| benchmark | result |\n|---|---|")
f = os.path.join(out, "bench_generate.json")
if os.path.exists(f):
    r = json.load(open(f))
    v = r["variants"][0]  # bench_generate's first (default: only) variant
    print(f"| reference batch (5x8, 100 tok) | {v['batch_s_median']*1e3:.1f} ms/batch, {v['decode_step_ms']:.3f} ms/step, "
          f"{v['floor_fraction']:.0%} of floor ({r['floor_s']*1e3:.1f} ms) |")
    if "hf_batch_s_median" in r:
        print(f"| HF generate static+compile | {r['hf_batch_s_median']*1e3:.1f} ms/batch |")
f = os.path.join(out, "bench_throughput.json")
if os.path.exists(f):
    r = json.load(open(f))
    print(f"| throughput (256 req) | {r['output_tok_per_s']:,.0f} output tok/s ({r['seconds']:.2f} s) |")
PY
