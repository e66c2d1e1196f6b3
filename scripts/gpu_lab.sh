#!/usr/bin/env bash
# The investigation modes of monorl's performance work (profiles, A/B runs against an older tree, kernel sweeps), as
# benchmarks/RESULTS.md quotes them (`bash scripts/gpu_check.sh MODE`: gpu_check.sh forwards every mode that is not
# one of its suites here). The everyday checks are scripts/gpu_check.sh's suites: tests, bench, wall, scale.
# Modes (`wall` here is the older timestamped / -X importtime / cProfile run: `bash scripts/gpu_lab.sh wall`):
#   tests:   all GPU tests (pytest -m gpu)
#   trainer: the trainer-graph GPU tests, then benchmarks/profile_train_step.py (eager / graphs / compiled)
#   profile: benchmarks/profile_train_step.py only
#   loop:    the RL-loop table (benchmarks/bench_rl_loop.py, one fresh process per column)
#   compare: this tree against an older one in BASE (a copy of its src/ and benchmarks/, e.g. from
#            `git archive REV src benchmarks`, carried in an ignored folder): the reference generator batch
#            and the RL loop's trainer-graph columns, cold and warm, both on this device in this call
#   startup: benchmarks/profile_startup.py, then the RL-loop table with the real tokenizer (.models, carried) for the
#            preset as users run it (compile.backend auto) and CUDA graphs alone
#   scale:   benchmarks/bench_scale.py on every GPU of the machine (2 or 4) and on one of them, the same rows
#   scale_compile: the reference preset compiled (Inductor) from a cold cache on 1 rank and on all ranks: startup
#   bi_cost: the batch-invariant mode's cost: trainer step profiled (default vs mode), then the RL loop with and
#            without the mode (compiled + graphs, and graphs alone) on Qwen3-0.6B; bi_cost_1.7b: the loop on 1.7B
#   kernels: all GPU tests, then the reference generator batch in each variant (CUDA graphs with the fused kernels,
#            with the model's eager ops, and those compiled), profiled
#   wall:    the preset as users run it, twice (cold then warm Triton cache), output timestamped, imports timed;
#            then once under cProfile
#   wall_user: the preset's process wall time with Python's bytecode cache and the compile caches kept across runs
#            (3 runs each of compile.backend auto and inductor): cold first run, then warm
#   bi_kernels: all GPU tests, then benchmarks/bench_batch_invariant.py: default, the mode, the mode on PyTorch ops
#   bi_default: the preset (mode auto: on for full fine-tuning): `monorl parity` on and off; the rollout correction in trainer graphs
#   bi_lora: the mode's cost with LoRA rank 16 (Qwen3-0.6B and 8B; the preset's settings otherwise)
#   cold:    the preset's cold start kernel by kernel: a first run writes Python's bytecode cache (a user's pip
#            install ships it), then a run on an empty Triton cache with every Triton compile and launcher build
#            timed (benchmarks/trace_triton_jit.py), then warm; then the process exit: `python -m monorl.cli`
#            (the prompt exit) against `main()` returning to the interpreter, twice each; then the trainer step in
#            the mode without compile (the preset's default), profiled; bwd: the fused-kernel and batch-invariant
#            GPU tests, then cold without the exit comparison
#   kept:    the kept kernel list and the KV write in the q/k pass: GPU tests, warm runs with and without the
#            list, the generator batch against BASE (.base), throughput
#   decode_profile: the generator batch's top kernels per mode; the invariant GEMM's tilings at decode rows
#   attn:    the throughput run split, the paged decode attention's bandwidth (256 and 40 rows), the trainer's ATen
#            ops by shape
#   compiled_warm_profile: a warm run of the preset compiled (Inductor) under cProfile: its compile path
#   warm_profile: a warm run of the preset (caches and kept kernel list written) under cProfile
#   timeline: the preset cold, then twice warm with stamped output lines; TRAIN_PROFILE=1: the trainer's ATen ops
#   warmup_profile: the warm-up alone under cProfile (benchmarks/profile_startup.py --only-warm-up), caches warm
#   ahead:   Triton kernels compiled ahead in threads vs at first launch: the loop GPU tests, cold and warm runs of the
#            preset each way; then the generator's top kernels default vs batch-invariant
#   rl_step: one steady RL step, GPU busy against host, idle gaps by phase (RL_SIDES="new base": also .base's, in
#            turns); the mode's trainer step profiled; the norm backward's launch swept (SKIP_TRAIN, SKIP_RMS skip them)
#   ab:      this tree against BASE (.base, `git archive REV src benchmarks`), in turns (new, base, new, base): the
#            generator batch (default, the mode) and the decode step, then throughput (THROUGHPUT= skips it); GPU
#            tests first (TESTS: which) unless SKIP_TESTS; BENCH= skips the batches; with WALL=1 the preset's
#            process wall (bytecode primed; WALL_RUNS, default cold, then warm twice) of each tree; TRAIN (sides): the
#            mode's trainer step with graphs; WHO=1: who imports torch._dynamo in a warm run of this tree
#   decode_step: benchmarks/profile_decode_step.py of this tree and of BASE (.base): the graphed decode step, then
#            kernel by kernel (SIDES, MODES, ROWS)
#   bi:      `monorl train` of the Qwen3-0.6B preset (random weights) with --batch_invariant true (trainer graphs on)
# Usage on the device: bash scripts/gpu_lab.sh [tests|trainer|profile|loop|compare|startup|scale|scale_compile|bi_cost|bi_cost_1.7b|bi_kernels|bi_default|bi_lora|kernels|wall|wall_user|cold|bwd|ahead|kept|decode_profile|decode_step|attn|compiled_warm_profile|warm_profile|warmup_profile|timeline|rl_step|ab|bi|all]   (logs, JSON under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/monorl_out}; mkdir -p "$OUT"
# wheels the device lacks (jsonargparse) go first: .whl carried, installed to /tmp/site (device README)
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
what=${1:-all}
model_path() {  # a folder with the released Qwen3-SIZE config and the real tokenizer (from .models, carried)
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from bench_memory import model_dir
print(model_dir(Path('.models'), 'qwen3-$1'))"
}
preset_args() {  # the reference workload as #18 times it: the preset, Qwen3-0.6B's config with random weights
  echo "--preset qwen3_0_6b_sum_digits --model.path $(model_path 0.6b) --model.random_init true --rollout.ignore_eos true
        --checkpoint.final false --checkpoint.every_minutes 0"
}
user_bytecode() {  # Python writes its bytecode cache as on a user's machine (the device image sets
  # PYTHONDONTWRITEBYTECODE and ships torch without one); given RUN_DIR LOG, one run of the preset writes it first
  unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
  if [[ $# == 2 ]]; then TRITON_CACHE_DIR=/tmp/tc_prime python3 -m monorl.cli train $(preset_args) --run_dir "$1" > "$2" 2>&1; fi
}
profile_train() {  # PROF ARGS...: `monorl train ARGS` under cProfile (imports included) into PROF; through main(),
  # since the command's prompt exit (cli.entry) would skip cProfile's write
  python3 - "$@" <<'PY'
import cProfile, sys
out, argv = sys.argv[1], ["train", *sys.argv[2:]]
cProfile.run("import monorl.cli as cli; cli.main(argv)", out)
PY
}
generator_batches() {  # SIDE DIR: the generator batch (default, the mode) and the decode step of this tree (new) or
  # .base (base), JSON into DIR
  local src=$PWD; [[ $1 == base ]] && src=$PWD/.base
  PYTHONPATH=$src/src:/tmp/site python3 "$src/benchmarks/bench_batch_invariant.py" --out "$2/bench_bi_$1.json" \
    2>&1 | grep -v DEBUG | tail -4 | sed "s/^/$1: /"
  PYTHONPATH=$src/src:/tmp/site python3 "$src/benchmarks/bench_generate.py" --variants graphs \
    --out "$2/generate_$1.json" 2>&1 | grep -E "^\| (variant|graphs)" | sed "s/^/$1: /"
}
# one table row from a run's summary.json: RUN_DIR LABEL T0 T1 -> | label | process wall | total | startup | steady |
stamp='import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    print(f"{time.time() - t0:6.2f} {line}", end="", flush=True)
print(f"{time.time() - t0:6.2f} (output closed: the process exited)")'
summary='import json, sys; s = json.load(open(sys.argv[1] + "/summary.json"))
wall = float(sys.argv[4]) - float(sys.argv[3])
rw, t, st, ss = (s[k] for k in ("wall_s", "total_s", "startup_s", "steady_step_s"))
print(f"| {sys.argv[2]} | {wall:.2f} | {rw:.2f} | {t:.2f} | {st:.2f} | {ss:.3f} |")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log --oneline -1 2>/dev/null || true
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $what == trainer ]]; then
  python3 -m pytest -q -m gpu tests/test_trainer_graphs_gpu.py tests/test_fused_weights.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests_trainer.log" | tail -25
fi
if [[ $what == trainer || $what == profile || $what == all ]]; then
  python3 benchmarks/profile_train_step.py --out "$OUT/train_step.json" 2>&1 | tee "$OUT/profile_train.log" \
    | grep -v DEBUG | tail -45
fi
if [[ $what == loop || $what == all ]]; then
  python3 benchmarks/bench_rl_loop.py --out "$OUT/rl_loop.json" 2>&1 | tee "$OUT/rl_loop.log"
fi
if [[ $what == startup ]]; then
  python3 benchmarks/profile_startup.py --model-dir .models --top 25 2>&1 | tee "$OUT/profile_startup.log" | head -90
  python3 benchmarks/bench_rl_loop.py --model-dir .models --columns preset_auto,nocompile_graphs \
    --out "$OUT/rl_loop_startup.json" 2>&1 | tee "$OUT/rl_loop_startup.log"
fi
if [[ $what == scale || $what == scale_compile ]]; then
  nvidia-smi topo -m 2>&1 | head -6; env | grep -E "NVLS|MULTICAST" || true
  n=$(python3 -c "import torch; print(torch.cuda.device_count())")
fi
if [[ $what == scale ]]; then
  python3 benchmarks/bench_scale.py --nproc "$n" --rows 8b,weak,ref8 --out "$OUT/scale_$n.json" 2>&1 \
    | tee "$OUT/scale_$n.log" | grep -E "^\||failed|Error|error" | tail -20
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_scale.py --nproc 1 --rows weak,ref8,8b --out "$OUT/scale_1.json" 2>&1 \
    | tee "$OUT/scale_1.log" | grep -E "^\||failed|Error|error" | tail -20
fi
if [[ $what == scale_compile ]]; then  # cold caches of their own; startup_s is what item 4 of the issue compares
  for k in 1 "$n"; do
    rm -rf "/tmp/cc_$k"
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((k - 1))) python3 benchmarks/bench_scale.py --nproc "$k" --rows ref8 --steps 3 \
      --compile.backend inductor --compile.cache_dir "/tmp/cc_$k" --out "$OUT/scale_compile_$k.json" 2>&1 \
      | tee "$OUT/scale_compile_$k.log" | grep -E "^\||failed|Error|error" | tail -8
  done
fi
if [[ $what == bi_cost ]]; then
  python3 benchmarks/profile_train_step.py --variants compiled,bi_eager,bi_compiled --profile bi_compiled,compiled \
    --out "$OUT/train_step_bi.json" 2>&1 | tee "$OUT/profile_train_bi.log" | grep -v DEBUG | grep -v "^-" \
    | grep -E "step times|profile of|Name|^\|| [0-9.]+ms|us " | cut -c1-140 | head -60
  python3 benchmarks/bench_rl_loop.py --model-dir .models --columns graphs,bi_graphs,nocompile_graphs,bi_nocompile_graphs \
    --out "$OUT/rl_loop_bi.json" 2>&1 | tee "$OUT/rl_loop_bi.log" | grep -v DEBUG | tail -22
fi
if [[ $what == bi_kernels ]]; then  # all GPU tests, then the mode's generator and eager train step: default, the mode
  # on the block kernels, the mode on the PyTorch ops (as before them), each batch's top kernels
  python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_bi.log" \
    | grep -E "^(FAILED|ERROR)|passed|failed" | tail -15
  python3 benchmarks/bench_batch_invariant.py --ops --profile --out "$OUT/bench_bi.json" 2>&1 \
    | tee "$OUT/bench_bi.log" | grep -v DEBUG | tail -66
fi
if [[ $what == bi_default ]]; then  # the Qwen3 preset, the mode on (auto, full fine-tuning): `monorl parity` with and without
  # it, then 3 steps with it off and the rollout correction on (TIS + token rejection) inside trainer CUDA graphs
  d=$(model_path 0.6b)
  args="--preset qwen3_0_6b_sum_digits --model.path $d --model.random_init true"
  for bi in true false; do
    python3 -m monorl.cli parity $args --batch_invariant $bi 2>&1 | grep -E "^parity|PASS|FAIL"
  done
  python3 -m monorl.cli train $args --rollout.ignore_eos true --checkpoint.final false --steps 3 \
    --batch_invariant false --trainer.loss.rollout_correction.rollout_is token \
    --trainer.loss.rollout_correction.rollout_rs token --trainer.loss.rollout_correction.rollout_rs_threshold 1.01 \
    --run_dir /tmp/corr_run > "$OUT/corr_run.log" 2>&1; echo "train rc $?"
  python3 -c "import json
for line in open('/tmp/corr_run/metrics.jsonl'):
    m = json.loads(line)
    keep = {k: round(v, 5) for k, v in m.items() if isinstance(v, (int, float))
            and (k.startswith(('rollout_corr/', 'logprob_diff', 'trainer/graph')) or k == 'step')}
    if keep: print(keep)
print('trainer graphs:', json.load(open('/tmp/corr_run/summary.json'))['trainer_graphs'])"
  python3 benchmarks/bench_rl_loop.py --model-dir .models --columns preset_auto --out "$OUT/rl_loop_preset.json" 2>&1 \
    | grep -E "^\|" | tail -20
fi
if [[ $what == bi_lora ]]; then  # the mode's cost with LoRA (rank 16): Qwen3-0.6B and 8B, the preset's defaults
  for size in 0.6b 8b; do
    d=$(model_path "$size")
    for bi in false true; do
      python3 -m monorl.cli train --preset qwen3_0_6b_sum_digits --model.path "$d" --model.random_init true \
        --rollout.ignore_eos true --checkpoint.final false --checkpoint.every_minutes 0 --lora.rank 16 \
        --batch_invariant $bi --run_dir "/tmp/lora_${size}_$bi" > "$OUT/lora_${size}_$bi.log" 2>&1
      python3 -c "import json; s = json.load(open('/tmp/lora_${size}_$bi/summary.json'))
print(f'| $size | $bi | {s[\"generate_s\"]:.2f} | {s[\"train_s\"]:.2f} | {s[\"steady_step_s\"]:.3f} | {s[\"logprob_diff_max\"]} |')"
    done
  done
fi
if [[ $what == bi_cost_1.7b ]]; then
  python3 benchmarks/bench_rl_loop.py --model-dir .models --size 1.7b --columns graphs,bi_graphs \
    --out "$OUT/rl_loop_bi_1.7b.json" 2>&1 | tee "$OUT/rl_loop_bi_1.7b.log" | grep -v DEBUG | tail -22
fi
if [[ $what == kernels ]]; then
  python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_kernels.log" \
    | grep -E "^(FAILED|ERROR)|passed|failed" | tail -15
  python3 benchmarks/bench_generate.py --variants graphs_eager_ops,graphs,compiled_eager_ops --profile \
    --out "$OUT/generate_kernels.json" > "$OUT/generate_kernels.log" 2>&1
  grep -E "^-- |Self CUDA time total" "$OUT/generate_kernels.log"; tail -8 "$OUT/generate_kernels.log"
fi
if [[ $what == wall ]]; then  # where the preset's process wall time goes: timestamped output, imports, cProfile
  args="$(preset_args) --compile.cache_dir /tmp/cc_wall"
  stamp='import sys, time; t0 = float(sys.argv[1])
for line in sys.stdin: print(f"{time.time() - t0:6.2f} {line.rstrip()[:150]}", flush=True)'
  for run in 1 2; do
    t0=$(date +%s.%N)
    python3 -X importtime -m monorl.cli train $args --run_dir /tmp/wall$run 2> "$OUT/importtime_$run.txt" \
      | python3 -c "$stamp" "$t0" | grep -v -e DEBUG -e "^ *[0-9.]* *|" | tail -22
    python3 -c "import time; print(f'{time.time() - $t0:6.2f} process end')"
  done
  sort -t'|' -k2 -n -r "$OUT/importtime_2.txt" | head -14
  profile_train "$OUT/wall.prof" $args --run_dir /tmp/wall3 > /dev/null 2>&1
  python3 -c "import pstats; pstats.Stats('$OUT/wall.prof').sort_stats('cumulative').print_stats(50)" | cut -c1-160 \
    | tail -58
fi
if [[ $what == wall_user ]]; then  # the preset's process wall time as a user's machine sees it: Python writes its
  # bytecode cache (the device image sets PYTHONDONTWRITEBYTECODE and ships torch without one), Triton's and
  # Inductor's caches persist across runs; 3 runs each of the preset (auto) and of it compiled
  args="$(preset_args) --compile.cache_dir /tmp/cc_user"
  user_bytecode
  for backend in auto inductor; do
    for run in 1 2 3; do
      t0=$(date +%s.%N)
      python3 -m monorl.cli train $args --compile.backend $backend --run_dir "/tmp/wu_${backend}_$run" \
        > "$OUT/wall_user_${backend}_$run.log" 2>&1
      t1=$(date +%s.%N)
      python3 -c "$summary" "/tmp/wu_${backend}_$run" "$backend | $run" "$t0" "$t1"
    done
  done
fi
if [[ $what == bwd ]]; then
  python3 -m pytest -q -m gpu tests/test_fused_kernels.py tests/test_batch_invariant_gpu.py tests/test_trainer_graphs_gpu.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_bwd.log" | grep -E "^(FAILED|ERROR)|passed|failed|Error" | tail -15
  what=cold EXIT_RUNS=0
fi
if [[ $what == cold ]]; then
  args=$(preset_args)
  user_bytecode /tmp/cold0 "$OUT/cold_prime.log"
  rows=""
  for run in cold warm; do
    t0=$(date +%s.%N)
    TRITON_CACHE_DIR=/tmp/tc_user python3 benchmarks/trace_triton_jit.py --trace-out "$OUT/triton_$run.json" \
      train $args --run_dir "/tmp/cold_$run" > "$OUT/cold_$run.log" 2>&1
    t1=$(date +%s.%N)
    grep -E "^startup|^\| " "$OUT/cold_$run.log" | head -40
    rows+=$(python3 -c "$summary" "/tmp/cold_$run" "traced, $run Triton cache" "$t0" "$t1")$'\n'
  done
  for run in $(seq 1 "${EXIT_RUNS:-2}"); do  # EXIT_RUNS=0 skips the exit comparison
    for how in "entry" "main"; do
      t0=$(date +%s.%N)
      if [[ $how == entry ]]; then
        TRITON_CACHE_DIR=/tmp/tc_user python3 -m monorl.cli train $args --run_dir "/tmp/exit_$how$run" > /dev/null 2>&1
      else
        TRITON_CACHE_DIR=/tmp/tc_user python3 -c "import sys; from monorl.cli import main; sys.exit(main())" \
          train $args --run_dir "/tmp/exit_$how$run" > /dev/null 2>&1
      fi
      t1=$(date +%s.%N)
      rows+=$(python3 -c "$summary" "/tmp/exit_$how$run" "$how, run $run" "$t0" "$t1")$'\n'
    done
  done
  python3 benchmarks/profile_train_step.py --variants bi_eager,bi_graphs --profile bi_eager --rows 30 \
    --out "$OUT/train_step_bi_eager.json" 2>&1 | tee "$OUT/profile_train_bi_eager.log" | grep -v DEBUG | grep -v "^-" \
    | grep -E "step times|profile of|Name|^\||by kind| [0-9.]+ms|us " | cut -c1-150 | head -50
  printf "\n| run | process wall s | run wall s | run total s | startup s | steady step s |\n|---|---|---|---|---|---|\n%s" "$rows"
fi
if [[ $what == ahead ]]; then  # Triton kernels compiled ahead in threads (compile.kernel_compile_threads 0) against at
  # their first launch (1): the GPU test, then cold (empty Triton cache, every compile timed) and warm runs of the
  # preset, alternating; then the generator's top kernels per mode (where a decode step goes)
  python3 -m pytest -q -m gpu tests/test_loop_gpu.py tests/test_generate_gpu.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests_ahead.log" | grep -E "^(FAILED|ERROR)|passed|failed|Error" | tail -15
  args=$(preset_args)
  user_bytecode /tmp/ah0 "$OUT/ahead_prime.log"
  rows=""
  for run in cold warm1 warm2; do
    for th in 0 1; do
      t0=$(date +%s.%N)
      if [[ $run == cold ]]; then
        TRITON_CACHE_DIR=/tmp/tc_$th python3 benchmarks/trace_triton_jit.py --trace-out "$OUT/triton_ahead_$th.json" \
          train $args --compile.kernel_compile_threads $th --run_dir "/tmp/ah_${run}_$th" > "$OUT/ahead_${run}_$th.log" 2>&1
      else
        TRITON_CACHE_DIR=/tmp/tc_$th python3 -m monorl.cli train $args --compile.kernel_compile_threads $th \
          --run_dir "/tmp/ah_${run}_$th" > "$OUT/ahead_${run}_$th.log" 2>&1
      fi
      t1=$(date +%s.%N)
      grep -E "^triton:|^\| total" "$OUT/ahead_${run}_$th.log"
      rows+=$(python3 -c "$summary" "/tmp/ah_${run}_$th" "threads $th, $run" "$t0" "$t1")$'\n'
    done
  done
  grep -E "^startup:" "$OUT"/ahead_warm2_*.log | cut -c1-400
  python3 benchmarks/bench_batch_invariant.py --profile --out "$OUT/bench_bi_profile.json" 2>&1 \
    | tee "$OUT/bench_bi_profile.log" | grep -v DEBUG | tail -45 | cut -c1-160
  printf "\n| run | process wall s | run wall s | run total s | startup s | steady step s |\n|---|---|---|---|---|---|\n%s" "$rows"
fi
if [[ $what == kept ]]; then  # the kept kernel list (a warm run loads it instead of tracing) and the KV write in the
  # q/k pass: all GPU tests; the preset cold, then warm with the list kept against warm with it removed (traced
  # again), alternating on one Triton cache; the generator batch (default, the mode) of this tree against BASE
  # (.base: `git archive REV src benchmarks`); the generator's throughput
  if [[ -z ${SKIP_TESTS:-} ]]; then
    python3 -m pytest -q -m gpu ${TESTS:-tests/} -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" \
      | grep -E "^(FAILED|ERROR)|passed|failed|Error" | tail -15
  fi
  args=$(preset_args)
  user_bytecode /tmp/kp0 "$OUT/kept_prime.log"
  rows=""
  for run in cold kept1 traced1 kept2 traced2; do
    [[ $run == traced* ]] && rm -rf /tmp/tc_k/monorl_kernel_specs
    t0=$(date +%s.%N)
    TRITON_CACHE_DIR=/tmp/tc_k python3 -m monorl.cli train $args --run_dir "/tmp/kp_$run" > "$OUT/kept_$run.log" 2>&1
    t1=$(date +%s.%N)
    grep -E "^triton:|^\| total" "$OUT/kept_$run.log" | cut -c1-200
    rows+=$(python3 -c "$summary" "/tmp/kp_$run" "$run" "$t0" "$t1")$'\n'
  done
  grep -E "^startup:" "$OUT"/kept_kept2.log "$OUT"/kept_traced2.log | cut -c1-500
  if [[ -n ${BASE_WALL:-} ]]; then  # the same preset from .base: bytecode primed, then cold and warm twice
    PYTHONPATH=$PWD/.base/src:/tmp/site TRITON_CACHE_DIR=/tmp/tc_bprime python3 -m monorl.cli train $args \
      --run_dir /tmp/kb_prime > "$OUT/kept_base_prime.log" 2>&1
    for run in cold warm1 warm2; do
      t0=$(date +%s.%N)
      PYTHONPATH=$PWD/.base/src:/tmp/site TRITON_CACHE_DIR=/tmp/tc_b python3 -m monorl.cli train $args \
        --run_dir "/tmp/kb_$run" > "$OUT/kept_base_$run.log" 2>&1
      t1=$(date +%s.%N)
      rows+=$(python3 -c "$summary" "/tmp/kb_$run" "base $run" "$t0" "$t1")$'\n'
    done
  fi
  for side in new base; do generator_batches $side "$OUT"; done
  python3 benchmarks/bench_throughput.py --no-compile --out "$OUT/throughput.json" 2>&1 | grep -v DEBUG | tail -6
  printf "\n| run | process wall s | run wall s | run total s | startup s | steady step s |\n|---|---|---|---|---|---|\n%s" "$rows"
fi
if [[ $what == decode_profile ]]; then  # where a decode step goes now: the generator batch's top kernels per mode,
  # then the batch-invariant GEMM tilings at decode rows (BLOCK_M 64, 4 warps: the bitwise family) with deeper
  # pipelines and wider K blocks than the default sweep
  [[ -z ${SKIP_PROFILE:-} ]] && python3 benchmarks/bench_batch_invariant.py --profile --runs 3 \
    --out "$OUT/bench_bi_profile.json" 2>&1 | grep -v DEBUG | tail -50 | cut -c1-150
  python3 benchmarks/tune_decode_attention.py --out "$OUT/tune_decode_attention.json" 2>&1 | grep -v DEBUG | tail -60
  python3 benchmarks/tune_bi_matmul.py --ms 40 --block-m 64 --block-k 64,128,256 --stages 3,4,5,6 \
    --shapes "0.6b qkv fused,0.6b o,0.6b gate_up fused,0.6b down,0.6b lm head" --out "$OUT/tune_decode.json" 2>&1 \
    | grep -v -e DEBUG -e OutOfResources | tail -12
fi
if [[ $what == attn ]]; then  # where the throughput run's time goes: its prefill / decode split, the paged decode
  # attention's bandwidth at its batch (256) and at the RL loop's (40, caches rotated so they read cold), tilings
  # swept; the trainer step in the mode (eager), its ATen ops by input shapes
  python3 benchmarks/bench_throughput.py --no-compile --out "$OUT/throughput.json" 2>&1 | grep -v DEBUG | tail -6
  python3 benchmarks/tune_decode_attention.py --batch 256 --contexts 400,800 --spread --block-n 32,64,128 \
    --stages default,2,4 --warps 4,8 --out "$OUT/tda_256.json" 2>&1 | grep -v DEBUG | tail -40
  python3 benchmarks/tune_decode_attention.py --batch 40 --contexts 200 --copies 16 --block-n 32,64,128 \
    --stages default,2,4 --warps 4,8 --out "$OUT/tda_40.json" 2>&1 | grep -v DEBUG | tail -20
  python3 benchmarks/profile_train_step.py --variants bi_eager --profile bi_eager --rows 20 --shapes 45 \
    --out "$OUT/train_step.json" 2>&1 | grep -v DEBUG | cut -c1-230 | tail -100
fi
if [[ $what == compiled_warm_profile ]]; then  # where a warm compiled run's trainer compile goes: the preset with
  # --compile.backend inductor once (caches written), then again under cProfile: cumulative time of the compile path
  args="$(preset_args) --compile.backend inductor --compile.cache_dir /tmp/cc_cwp"
  user_bytecode
  python3 -m monorl.cli train $args --run_dir /tmp/cwp0 > "$OUT/cwp_prime.log" 2>&1
  grep -E "^startup|compile:" "$OUT/cwp_prime.log"
  profile_train "$OUT/cwp.prof" $args --run_dir /tmp/cwp1 > "$OUT/cwp_1.log" 2>&1
  grep -E "^startup|compile:" "$OUT/cwp_1.log"
  python3 -c "import pstats; s = pstats.Stats('$OUT/cwp.prof'); s.sort_stats('cumulative').print_stats(
    'dynamo|inductor|functorch|aot|compile|triton|warm_up|import', 60)" | cut -c1-180 | tail -64
fi
if [[ $what == warm_profile ]]; then  # where a warm run's wall time goes: the preset once (Triton cache, kept
  # kernel list and bytecode written), then again under cProfile (main thread): cumulative and own time
  args=$(preset_args)
  user_bytecode /tmp/wp0 "$OUT/warm_profile_prime.log"
  t0=$(date +%s.%N)  # a warm run, each line stamped with seconds since the process started
  python3 -m monorl.cli train $args --run_dir /tmp/wp1 2>&1 | python3 -c "$stamp" "$t0" > "$OUT/warm_profile_1.log"
  echo "warm run: $(python3 -c "print(f'{$(date +%s.%N) - $t0:.2f}')") s"; grep -v DEBUG "$OUT/warm_profile_1.log" \
    | grep -E "startup|triton|valid|step (1|10)/|compile|Summary" | cut -c1-200
  python3 -X importtime -c "import monorl.cli" 2>&1 | sort -t'|' -k2 -n | tail -12
  t0=$(date +%s.%N)
  profile_train "$OUT/warm.prof" $args --run_dir /tmp/wp2 > "$OUT/warm_profile_2.log" 2>&1
  t1=$(date +%s.%N)
  python3 -c "import pstats; s = pstats.Stats('$OUT/warm.prof'); s.sort_stats('cumulative').print_stats(70)" \
    | cut -c1-170 | tail -75
  python3 -c "import pstats; s = pstats.Stats('$OUT/warm.prof'); s.sort_stats('tottime').print_stats(30)" \
    | cut -c1-170 | tail -33
  echo "profiled run: $(python3 -c "print(f'{$t1 - $t0:.2f}')") s"
fi
if [[ $what == timeline ]]; then  # the preset once to write the caches, then twice warm, each line stamped with
  # seconds since the process started; with TRAIN_PROFILE=1 then the mode's eager trainer step, its ATen ops by shape
  args=$(preset_args)
  user_bytecode
  python3 -m monorl.cli train $args --run_dir /tmp/tl0 > "$OUT/timeline_0.log" 2>&1
  for run in 1 2; do
    t0=$(date +%s.%N)
    python3 -m monorl.cli train $args --run_dir /tmp/tl$run 2>&1 | python3 -c "$stamp" "$t0" > "$OUT/timeline_$run.log"
    grep -v DEBUG "$OUT/timeline_$run.log" | grep -E "batch_invariant|startup|triton:|valid|step (1|2|10)/|closed" \
      | cut -c1-330
  done
  if [[ -n ${TRAIN_PROFILE:-} ]]; then
    python3 benchmarks/profile_train_step.py --variants bi_eager --profile bi_eager --rows 30 --shapes 45 \
      --out "$OUT/train_step.json" 2>&1 | grep -v DEBUG | cut -c1-230 | tail -100
  fi
fi
if [[ $what == warmup_profile ]]; then  # the warm-up alone under cProfile, on warm caches (a first run writes them
  # and the kept kernel list): where the trainer's first pass and the captures go
  user_bytecode
  python3 benchmarks/profile_startup.py --model-dir .models --only-warm-up --top 5 > "$OUT/warmup_profile_0.log" 2>&1
  python3 benchmarks/profile_startup.py --model-dir .models --only-warm-up --top 45 2>&1 \
    | tee "$OUT/warmup_profile.log" | grep -v DEBUG | cut -c1-180 | grep -E "warm_up|startup split|triton:" 
fi
if [[ $what == rl_step ]]; then  # where a steady RL step goes, GPU busy against host (benchmarks/profile_rl_step.py);
  # the trainer step in the mode (eager), its kernels; the norm backward's launch swept in CUDA graphs
  for side in ${RL_SIDES:-new}; do  # RL_SIDES="new base ...": this tree and .base in turns
    src=$PWD; [[ $side == base ]] && src=$PWD/.base
    PYTHONPATH=$src/src:/tmp/site python3 "$src/benchmarks/profile_rl_step.py" --model-dir .models \
      --profile "${RL_PROFILE:-2}" --out "$OUT/rl_step_$side.json" 2>&1 | grep -v DEBUG \
      | grep -E "${RL_GREP:-.}" | tail -45 | cut -c1-220 | sed "s/^/$side: /"
  done
  [[ -z ${SKIP_TRAIN:-} ]] && python3 benchmarks/profile_train_step.py --variants bi_eager,bi_graphs --profile bi_eager \
    --rows 30 --out "$OUT/train_step.json" 2>&1 | grep -v DEBUG | cut -c1-200 | tail -45
  [[ -z ${SKIP_RMS:-} ]] && python3 benchmarks/tune_rms_backward.py --out "$OUT/tune_rms_backward.json" 2>&1 \
    | grep -v DEBUG | tail -40
fi
if [[ $what == ab ]]; then
  if [[ -z ${SKIP_TESTS:-} ]]; then
    python3 -m pytest -q -m gpu ${TESTS:-tests/} -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" \
      | grep -E "^(FAILED|ERROR)|passed|failed|Error" | tail -15
  fi
  mkdir -p /tmp/ab  # the device returns 8 files of $OUT: the JSON stays here
  for side in ${BENCH-new base new base}; do generator_batches $side /tmp/ab; done
  for side in ${TRAIN-}; do  # the mode's trainer step with graphs (TRAIN="new base new base": in turns)
    src=$PWD; [[ $side == base ]] && src=$PWD/.base
    PYTHONPATH=$src/src:/tmp/site python3 "$src/benchmarks/profile_train_step.py" --variants bi_graphs --profile "" \
      --out "/tmp/ab_train_$side.json" 2>&1 | grep -E "^\| bi_graphs|step times" | sed "s/^/$side: /"
  done
  for side in ${THROUGHPUT-new base}; do
    src=$PWD; [[ $side == base ]] && src=$PWD/.base
    PYTHONPATH=$src/src:/tmp/site python3 "$src/benchmarks/bench_throughput.py" --no-compile \
      --out "/tmp/ab_throughput_$side.json" 2>&1 | grep -E "tok/s|prefills|ring reads" | sed "s/^/$side: /"
  done
  if [[ -n ${WALL:-} ]]; then
    args=$(preset_args)
    user_bytecode
    rows=""
    for side in new base; do
      src=$PWD; [[ $side == base ]] && src=$PWD/.base
      PYTHONPATH=$src/src:/tmp/site TRITON_CACHE_DIR=/tmp/tc_prime_$side python3 -m monorl.cli train $args \
        --run_dir "/tmp/ab_prime_$side" > "/tmp/ab_prime_$side.log" 2>&1
    done
    for run in ${WALL_RUNS:-cold warm1 warm2}; do
      for side in new base; do
        src=$PWD; [[ $side == base ]] && src=$PWD/.base
        [[ $run == cold* ]] && rm -rf "/tmp/tc_ab_$side"  # each cold run on an empty Triton cache
        t0=$(date +%s.%N)
        PYTHONPATH=$src/src:/tmp/site TRITON_CACHE_DIR=/tmp/tc_ab_$side python3 -m monorl.cli train $args \
          --run_dir "/tmp/ab_${side}_$run" 2>&1 | python3 -c "$stamp" "$t0" > "/tmp/ab_${side}_$run.log"
        t1=$(date +%s.%N)
        rows+=$(python3 -c "$summary" "/tmp/ab_${side}_$run" "$side $run" "$t0" "$t1")$'\n'
        echo "$side $run: $(grep -oE 'gen [0-9.]+s train [0-9.]+s' "/tmp/ab_${side}_$run.log" | tr '\n' ' ' | cut -c1-400)"
      done
    done
    grep -h -E "^startup" /tmp/ab_new_warm2.log /tmp/ab_base_warm2.log | cut -c1-400
    if [[ -n ${WHO:-} ]]; then  # who imports torch._dynamo in a warm run of this tree (benchmarks/who_imports.py)
      TRITON_CACHE_DIR=/tmp/tc_ab_new python3 benchmarks/who_imports.py --watch torch._dynamo,torch._inductor,sympy,torch.distributed.tensor -- \
        train $args --run_dir /tmp/ab_who 2>&1 | grep -A16 "^\[who_imports\]"
    fi
    cp /tmp/ab_new_warm2.log /tmp/ab_base_warm2.log "$OUT"/
    printf "\n| run | process wall s | run wall s | run total s | startup s | steady step s |\n|---|---|---|---|---|---|\n%s" "$rows"
  fi
fi
if [[ $what == decode_step ]]; then
  for side in ${SIDES:-new base}; do
    src=$PWD; [[ $side == base ]] && src=$PWD/.base
    PYTHONPATH=$src/src:/tmp/site python3 "$PWD/benchmarks/profile_decode_step.py" --mode ${MODES:-default,invariant} \
      --out "$OUT/decode_step_$side.json" 2>&1 | grep -E "^(==|\|)" | head -${ROWS:-40} | sed "s/^/$side: /"
  done
fi
if [[ $what == bi ]]; then
  python3 -m monorl.cli train --preset qwen3_0_6b_sum_digits --model.shape qwen3-0.6b --rollout.ignore_eos true \
    --batch_invariant true --steps 3 --checkpoint.final false --run_dir /tmp/bi_run 2>&1 | tee "$OUT/bi_run.log" \
    | grep -v -e DEBUG -e Warning | tail -8
fi
if [[ $what == compare ]]; then
  BASE=${BASE:?set BASE to the older tree}
  for side in new base; do
    src=$PWD; [[ $side == base ]] && src=$PWD/$BASE
    PYTHONPATH=$src/src python3 "$src/benchmarks/bench_generate.py" --out "$OUT/generate_$side.json" 2>&1 \
      | grep -E "batch, median|decode step|floor|^\| compiled" | sed "s/^/$side: /"
    PYTHONPATH=$src/src python3 "$src/benchmarks/bench_rl_loop.py" --columns graphs,graphs_warm \
      --out "$OUT/rl_loop_$side.json" 2>&1 | grep -E "^graphs" | sed "s/^/$side: /"
  done
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
print("\n| | new | base |\n|---|---|---|")
g = {s: json.load(open(f"{out}/generate_{s}.json")) for s in ("new", "base")}
g = {s: r["variants"][0] if "variants" in r else r for s, r in g.items()}  # bench_generate before --variants: flat
print(f"| generator batch 5x8x100 (ms) | {g['new']['batch_s_median']*1e3:.1f} | {g['base']['batch_s_median']*1e3:.1f} |")
print(f"| decode step (ms) | {g['new']['decode_step_ms']:.3f} | {g['base']['decode_step_ms']:.3f} |")
r = {s: json.load(open(f"{out}/rl_loop_{s}.json"))["results"] for s in ("new", "base")}
for col in ("graphs", "graphs_warm"):
    for key in ("process_wall_s", "total_s", "startup_s", "generate_s", "train_s", "steady_step_s"):
        print(f"| {col} {key} | {r['new'][col][key]:.2f} | {r['base'][col][key]:.2f} |")
PY
fi
