#!/bin/bash
# #58's step targets: the RL step of the qwen3_5-0.8b hybrid shape against qwen3-0.6b's (W0's workload: 5 prompts
# x 8, 100 new tokens, EOS ignored, random init, char tokenizer on both), default mode and batch-invariant mode;
# each run a fresh process, STEPS steps (default 8), steady step and its split from summary.json
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
S=" ${SECTIONS:-rl split vl} "  # which parts run
[[ $S == *" rl "* ]] && for shape in ${SHAPES:-qwen3-0.6b qwen3_5-0.8b}; do
  for bi in false true; do
    d=/tmp/step_${shape}_$bi; rm -rf $d
    t0=$(date +%s.%N)
    timeout ${RLIMIT:-150} python3 -m monorl.cli train --preset qwen3_0_6b_sum_digits --model.shape $shape \
      --model.random_init true --rollout.ignore_eos true --checkpoint.final false --checkpoint.every_minutes 0 \
      --steps ${STEPS:-8} --batch_invariant $bi --run_dir $d > $OUT/step_${shape}_$bi.log 2>&1
    rc=$?; t1=$(date +%s.%N)
    python3 - "$d" "$shape" "$bi" "$rc" "$t0" "$t1" <<'PY'
import json, sys
d, shape, bi, rc, t0, t1 = sys.argv[1:]
try:
    s = json.load(open(f"{d}/summary.json"))
    print(f"{shape:13s} invariant={bi:5s} rc {rc} process {float(t1)-float(t0):6.2f} s startup {s['startup_s']:5.2f} s "
          f"steady step {s['steady_step_s']:.4f} s (generate {s['generate_s']:.2f} train {s['train_s']:.2f} s over "
          f"all steps) logprob_diff_max {s.get('logprob_diff_max')}")
except Exception as e:
    print(f"{shape} invariant={bi} rc {rc} no summary ({e})")
PY
    grep -E "Error|error:" $OUT/step_${shape}_$bi.log | grep -v DEBUG | tail -2
  done
done
# #62: the invariant GEMM's K parts (default off): bf16 (a) == (b), generator == trainer with parts on and with the
# defaults, then the 40-row timing that decides matmul_split.parts
[[ $S == *" split "* ]] || exit 0
timeout ${SLIMIT:-150} python3 -m pytest -v -p no:cacheprovider --tb=short -m "gpu or not gpu" \
  tests/test_matmul_invariant_split_gpu.py "tests/test_batch_invariant_gpu.py::test_eager_bitwise" \
  tests/test_batch_invariant_gpu.py::test_matmul_tilings_agree_bitwise \
  tests/test_batch_invariant_gpu.py::test_mm_silu_mul_equals_gemm_then_silu > $OUT/split_tests.log 2>&1
echo "split tests rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " $OUT/split_tests.log | cut -c1-160 | head -24
timeout 90 python3 benchmarks/tune_invariant_split.py --out $OUT/tune_invariant_split.json > $OUT/tune_split.log 2>&1
echo "tune rc $?"; tail -30 $OUT/tune_split.log
# #59: packs with images under trainer graphs: the GPU test, then the vision step eager and with trainer graphs
[[ $S == *" vl "* ]] || exit 0
timeout ${VLIMIT:-150} python3 -m pytest -v -p no:cacheprovider --tb=short -m "gpu or not gpu" \
  tests/test_trainer_graphs_gpu.py > $OUT/vl_graph_tests.log 2>&1
echo "trainer graph tests rc $?"; grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " $OUT/vl_graph_tests.log | cut -c1-160 | head -24
for g in "" "--trainer-graphs"; do
  timeout 150 python3 benchmarks/bench_vision_step.py $g --out $OUT/vision_step${g:+_graphs}.json > $OUT/vision${g:+_graphs}.log 2>&1
  echo "vision step ${g:-eager} rc $?"; grep -v DEBUG $OUT/vision${g:+_graphs}.log | tail -6
done
