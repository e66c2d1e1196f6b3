#!/bin/bash
# Session 17's second machine. STAGE=hybrid (the first call: carry .device/wheels .device/tok and the Gemma GGUF's
# sha256 and first part): #58's RL step with the batched chunked reference, the hybrid against Qwen3-0.6B, default
# mode. STAGE=part (carry the next part): joins the GGUF once every part is there. STAGE=monorl / STAGE=trl: #57's
# Gemma 3 270M preset beside TRL (bench_vs_trl.py, one side a call; the JSON kept in .device/vs between calls)
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
case ${STAGE:-hybrid} in
hybrid)
  bash scripts/device_setup.sh 2>&1 | tail -1
  bash scripts/device_setup.sh gemma3 2>&1 | grep -E "wait|OK|damaged"
  export PYTHONPATH=$PWD/src:$PWD/.device/site
  for shape in qwen3-0.6b qwen3_5-0.8b; do
    d=/tmp/step_$shape; rm -rf $d; t0=$(date +%s.%N)
    timeout ${RLIMIT:-100} python3 -m monorl.cli train --preset qwen3_0_6b_sum_digits --model.shape $shape \
      --model.random_init true --rollout.ignore_eos true --checkpoint.final false --checkpoint.every_minutes 0 \
      --steps ${STEPS:-5} --batch_invariant false --run_dir $d > $OUT/step_$shape.log 2>&1
    rc=$?; t1=$(date +%s.%N)
    python3 -c "import json,sys; s=json.load(open('$d/summary.json')); print('$shape default rc $rc process %.2f s startup %.2f steady step %.4f s (generate %.2f train %.2f over all steps) logprob_diff_max %s' % ($t1-$t0, s['startup_s'], s['steady_step_s'], s['generate_s'], s['train_s'], s.get('logprob_diff_max')))" \
      || { echo "$shape rc $rc no summary"; grep -E "Error|error:" $OUT/step_$shape.log | tail -2; }
  done
  # #57: the mode's generator == trainer after updates on a Gemma 3 shape (random init; the 270M GGUF run had
  # logprob_diff up to 2 after step 1 before the (1 + w) norms read the masters as their bf16 copy)
  d=/tmp/step_gemma3; rm -rf $d
  timeout 90 python3 -m monorl.cli train --preset qwen3_0_6b_sum_digits --model.shape gemma3-270m \
    --model.random_init true --rollout.ignore_eos true --checkpoint.final false --checkpoint.every_minutes 0 \
    --steps 4 --trainer.lr 1e-4 --batch_invariant true --run_dir $d > $OUT/step_gemma3.log 2>&1
  echo "gemma3-270m invariant rc $?"; grep -E "^step|Error|error:" $OUT/step_gemma3.log | cut -c1-150 | tail -5
  # #57: the decode step with each (1 + w) norm one kernel (the first profile today: 4.98 ms on, 10.39 off)
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_offset_rmsnorm_gpu.py 2>&1 | tail -2
  (cd benchmarks && PYTHONPATH=$PWD/../src:$PWD/../.device/site timeout 110 python3 profile_window_decode.py \
    --shape gemma3-270m --context 16384 --rows 64 --out $OUT/profile_window_decode2.json 2>&1 | grep -v USDT \
    | grep -E "window (on|off)|ms +[0-9]+x" | head -14)
  (cd benchmarks && PYTHONPATH=$PWD/../src:$PWD/../.device/site timeout 120 python3 bench_window_decode.py \
    --shapes gemma3-270m --rows 64 --contexts 4096,16384 --out $OUT/window_decode.json 2>&1 | grep "^|" );;
part)
  bash scripts/device_setup.sh gemma3 2>&1 | grep -E "wait|OK|damaged";;
monorl|trl)
  bash scripts/device_setup.sh gemma3 2>&1 | grep -E "wait|OK|damaged"
  export PYTHONPATH=$PWD/src:$PWD/.device/site
  mkdir -p .device/vs
  timeout ${VLIMIT:-450} python3 benchmarks/bench_vs_trl.py --preset gemma3_270m_arith \
    --model .device/model/gemma-3-270m-q4_k_m.gguf --steps ${STEPS:-100} --sides $STAGE --out .device/vs/vs_trl_gemma3.json \
    > $OUT/vs_$STAGE.log 2>&1
  echo "bench_vs_trl $STAGE rc $?"; cp .device/vs/*.json $OUT/ 2>/dev/null
  grep -vE "^step|it/s|s/it" $OUT/vs_$STAGE.log | tail -25
  grep -E "^step" $OUT/vs_$STAGE.log | sed -n '1p;$p';;
esac
