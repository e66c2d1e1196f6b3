#!/bin/bash
# Session 21. STAGE=v (carry .device/wheels .device/tok): #59 -- the vision step (images encoded in the trainer's
#   after_update, session 20's change, never timed) with one profiled training step per case, to see where the
#   image step's extra ~0.14 s of training goes. STAGE=v also carries .device/gguf.sha256 .device/parts/a (SmolLM2).
# STAGE=j (carry .device/parts/b): #60 -- demo_distill with a judge trained by RL on grading rows (judge_training.py):
#   the teacher (RL, every sample logged), one student, the judge's training, the judge-rewarded run, evaluations.
set -u
source scripts/gpu_common.sh  # the device's setup; w0_runs
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case ${STAGE:-v} in
v)
  timeout ${VLIMIT:-300} python3 benchmarks/bench_vision_step.py --trainer-graphs --profile ${TOP:-22} \
    ${CASES:+--cases $CASES} --out $OUT/vision_step_profiled.json > $OUT/vision_profiled.log 2>&1
  echo "vision step rc $?"; grep -v DEBUG $OUT/vision_profiled.log | grep -vE "^  step" | tail -90;;
j)
  bash scripts/device_setup.sh 2>&1 | grep -E "wait|damaged"
  m=.device/model/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout ${JLIMIT:-500} python3 benchmarks/demo_distill.py --model $m --part both --judge-model trained \
    --distill-lrs 1 --judge-train-steps ${JSTEPS:-100} --judge-lr ${JLR:-1e-5} --work /tmp/dd \
    --out $OUT/demo_distill_trained_judge.json > $OUT/demo_distill.log 2>&1
  echo "demo_distill rc $?"; grep -vE "DEBUG|^step |it/s|warm start" $OUT/demo_distill.log | tail -40
  cp /tmp/dd/judge_grading.jsonl $OUT/ 2>/dev/null
  for r in judge_train judge_run; do tail -3 /tmp/dd/$r/samples.jsonl > $OUT/${r}_samples_tail.jsonl 2>/dev/null; done;;
v2)  # #59: the vision step at the default micro-batch budget and at one large enough for one micro-batch a step
  for mbt in 8192 32768; do
    timeout 150 python3 benchmarks/bench_vision_step.py --trainer-graphs --micro-batch-tokens $mbt \
      --out $OUT/vision_step_mbt$mbt.json > $OUT/vision_mbt$mbt.log 2>&1
    echo "micro_batch_tokens $mbt rc $?"; grep -v DEBUG $OUT/vision_mbt$mbt.log | grep -vE "^  step" | tail -7
  done;;
w)  # #62: W0 (the reference workload) on a fresh machine, then warm: process wall around the CLI (carry
  # .device/wheels .device/tok .device/gguf.sha256 .device/parts/a: the next call, STAGE=j2, brings part b)
  w0_runs;;
j2)  # #60: the judge trained on graded answers that write the compared numbers first (carry .device/parts/b)
  bash scripts/device_setup.sh 2>&1 | grep -E "wait|damaged"
  m=.device/model/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout ${JLIMIT:-500} python3 benchmarks/demo_distill.py --model $m --part judge --judge-model trained \
    --work /tmp/dj --out $OUT/demo_judge_trained.json > $OUT/demo_judge.log 2>&1
  echo "demo_distill rc $?"; grep -vE "DEBUG|^step |it/s|warm start" $OUT/demo_judge.log | tail -14
  grep -E "^step (1|20|40|60|80|99) " $OUT/demo_judge.log | cut -c1-160
  for r in judge_train judge_run; do tail -4 /tmp/dj/$r/samples.jsonl > $OUT/${r}_samples_tail.jsonl 2>/dev/null; done
  head -c 3000 /tmp/dj/judge_grading.jsonl > $OUT/judge_grading_head.jsonl;;
esac
