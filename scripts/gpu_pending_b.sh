#!/bin/bash
# Session 13's unrun GPU call B (after A on the same machine; carry .device/parts/a then b): the GGUF joined; where W0's process time goes before the run's clock; distillation (#60) and then the judge-rewarded run with its teacher as the judge
set -u
export PYTHONUNBUFFERED=1 JSONARGPARSE_DEPRECATION_WARNINGS=off
[ -d .models ] || tar xzf .device/tok/models.tgz
bash scripts/device_setup.sh 2>&1 | tail -1
export PYTHONPATH=$PWD/src:$PWD/.device/site
G=$(ls .device/model/*.gguf)
for i in 1 2; do python3 -c "import time;t=time.perf_counter();import torch;print('import torch %.2f s'%(time.perf_counter()-t))"; done
python3 -X importtime -c "import monorl.cli" 2> $OUT/importtime.txt
python3 - <<'PY'
import os
rows=[l.split('|') for l in open(os.environ['OUT']+'/importtime.txt') if l.startswith('import time:') and 'cumulative' not in l]
rows=[(int(r[1]), r[2].rstrip()) for r in rows]
for us, name in sorted(rows, reverse=True)[:10]: print(f"{us/1e6:6.2f} s  {name}")
PY
M=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from bench_memory import model_dir; print(model_dir(Path('.models'), 'qwen3-0.6b'))")
t0=$(date +%s.%N); python3 benchmarks/probe_pre_run.py $M 2>&1 | head -12; echo "pre_run process $(python3 -c "print(round($(date +%s.%N)-$t0,2))") s"
timeout 120 python3 benchmarks/demo_distill.py --model $G --part distill --distill-lrs 1 --out $OUT/demo.json > $OUT/distill.log 2>&1; echo "distill rc $?"
grep -v "DEBUG\|^step \|it/s" $OUT/distill.log | tail -9
# the judge (JUDGE=1): the teacher part (a) just trained (pass@1 ~0.58), reference-guided (the start model, on CPU, graded wrong answers 0.79)
[ "${JUDGE:-0}" = 1 ] && timeout 150 python3 benchmarks/demo_distill.py --model $G --part judge --judge-model teacher --out $OUT/demo.json > $OUT/judge.log 2>&1; echo "judge rc $?"
[ "${JUDGE:-0}" = 1 ] && grep -v "DEBUG\|^step \|it/s" $OUT/judge.log | tail -8
