#!/bin/bash
# Session 18: why Gemma-3-270M learns less in monorl than in TRL (#57). STAGE=diag (the first call: carry
# .device/wheels .device/tok .device/gemma3/gguf.sha256 .device/gemma3/parts/a): the mode's gradients on the GPU
# against an fp32 reference (shared prompts, Gemma's head_dim 256), the masters-as-bf16 checks on CUDA.
# STAGE=part (carry the next part). STAGE=learn (with the last part): the preset several ways
# (benchmarks/learn_variants.py: seeds, the default mode with TIS, unshared prompts, fp32 sides), VARIANTS picks a
# subset. STAGE=trl SEED=N: TRL's side alone. Next (session 19): VARIANTS="s0 s1 s2" again, since stop_without_signal
# no longer stops a converged run, so every seed reaches 100 steps and a post-RL validation.
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
case ${STAGE:-diag} in
diag)
  bash scripts/device_setup.sh 2>&1 | tail -1
  bash scripts/device_setup.sh gemma3 2>&1 | grep -E "wait|OK|damaged"
  export PYTHONPATH=$PWD/src:$PWD/.device/site
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider --tb=short -m gpu tests/test_mode_gradients_gpu.py \
    2>&1 | grep -vE "^\s*$" | tail -30
  timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=line -m gpu tests/test_offset_rmsnorm_gpu.py \
    tests/test_mode_master_rounding.py 2>&1 | tail -4;;
part)
  bash scripts/device_setup.sh gemma3 2>&1 | grep -E "wait|OK|damaged";;
learn)
  bash scripts/device_setup.sh gemma3 2>&1 | grep -E "wait|OK|damaged"
  export PYTHONPATH=$PWD/src:$PWD/.device/site
  m=.device/model/gemma-3-270m-q4_k_m.gguf
  declare -A V=(
    [s0]="mode s0=--seed 0"
    [s1]="mode s1=--seed 1"
    [s2]="mode s2=--seed 2"
    [tis]="default tis s0=--seed 0 --batch_invariant false --trainer.loss.rollout_correction.rollout_is token"
    [unshared]="mode unshared s0=--seed 0 --trainer.share_prompts false"
    [g32]="default gen fp32 s0=--seed 0 --batch_invariant false --generator.dtype float32"
    [g32s1]="default gen fp32 s1=--seed 1 --batch_invariant false --generator.dtype float32"
    [all32]="default all fp32 s0=--seed 0 --batch_invariant false --generator.dtype float32 --trainer.compute_dtype float32"
    [mode32]="mode fp32 s0=--seed 0 --batch_invariant true --generator.dtype float32 --trainer.compute_dtype float32"
    [mode32s1]="mode fp32 s1=--seed 1 --batch_invariant true --generator.dtype float32 --trainer.compute_dtype float32"
  )
  args=()
  for k in ${VARIANTS:-s0 s1 s2 tis unshared}; do args+=(--variant "${V[$k]}"); done
  timeout ${LLIMIT:-560} python3 benchmarks/learn_variants.py --preset gemma3_270m_arith --model $m \
    --timeout ${VTIMEOUT:-150} --out $OUT/learn "${args[@]}" 2>&1 | grep -vE "^step" | tail -30
  rm -rf $OUT/learn/*/ $OUT/learn/*.log;;
trl)  # TRL's side alone, SEED (default the preset's)
  bash scripts/device_setup.sh gemma3 2>&1 | grep -E "wait|OK|damaged"
  export PYTHONPATH=$PWD/src:$PWD/.device/site
  timeout ${VLIMIT:-450} python3 benchmarks/bench_vs_trl.py --preset gemma3_270m_arith --seed ${SEED:-0} \
    --model .device/model/gemma-3-270m-q4_k_m.gguf --sides trl --out $OUT/vs_trl_s${SEED:-0}.json > $OUT/trl.log 2>&1
  echo "trl rc $?"; grep -vE "it/s|s/it" $OUT/trl.log | tail -8;;
esac
