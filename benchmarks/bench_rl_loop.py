"""The reference table on one GPU: 10 GRPO steps of Qwen3-0.6B shapes (random init, EOS ignored, the
qwen3_0_6b_sum_digits workload: 5 prompts x 8, 100 new tokens), one run per column, each in a fresh
process so startup is real:

  eager              no compile, no CUDA graphs
  compiled_gen       generator: regional inductor compile + decode CUDA graphs; trainer eager
  compiled_all       + trainer blocks compiled (packed varlen micro-batches, as always)
  compiled_all_warm  the same again with the compile cache the previous run filled
  graphs             + trainer CUDA graphs (each micro-batch's fwd+bwd one replay; generator and trainer
                       share one compile cache directory, as in every column)
  graphs_warm        the same again on that warm cache

Rows: total (startup + steps), startup, generator, trainer, weight sync; plus the steady-state step.
Prints a markdown table and writes JSON.

  python benchmarks/bench_rl_loop.py --out results.json [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE = ["--preset", "qwen3_0_6b_sum_digits", "--model.shape", "qwen3-0.6b", "--rollout.ignore_eos", "true",
        "--checkpoint.final", "false", "--checkpoint.every_minutes", "0"]

NO_TRAINER_GRAPHS = ["--compile.trainer_cuda_graphs", "false"]
COLUMNS = {
    "eager": (["--compile.backend", "none", "--compile.decode_cuda_graphs", "false", *NO_TRAINER_GRAPHS], "eager"),
    "compiled_gen": (["--compile.backend", "inductor", "--compile.trainer", "false", *NO_TRAINER_GRAPHS], "gen"),
    "compiled_all": (["--compile.backend", "inductor", *NO_TRAINER_GRAPHS], "all"),
    "compiled_all_warm": (["--compile.backend", "inductor", *NO_TRAINER_GRAPHS], "all"),  # same cache dir: warm
    "graphs": (["--compile.backend", "inductor", "--compile.trainer_cuda_graphs", "true"], "graphs"),
    "graphs_warm": (["--compile.backend", "inductor", "--compile.trainer_cuda_graphs", "true"], "graphs"),
}

ROWS = [("total_s", "total"), ("startup_s", "startup"), ("generate_s", "generator"), ("train_s", "trainer"),
        ("sync_s", "weight sync"), ("steady_step_s", "steady-state step"), ("compile_s", "compile (in startup)")]


def run_column(name: str, extra: list[str], cache: Path, workdir: Path, steps: int) -> dict:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "monorl.cli", "train", *BASE, *extra, "--steps", str(steps),
           "--run_dir", str(run_dir), "--compile.cache_dir", str(cache)]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    log = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(log)
    if proc.returncode != 0:
        print(log[-4000:], file=sys.stderr)
        raise SystemExit(f"{name} failed with exit code {proc.returncode}")
    out = json.loads((run_dir / "summary.json").read_text())
    out["process_wall_s"] = wall
    out["summary_lines"] = [ln for ln in log.splitlines() if ln.startswith(("startup", "compile:", "  Pre", "  Post"))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="rl_loop_results.json")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--columns", default=",".join(COLUMNS))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    results = {}
    for name in args.columns.split(","):
        extra, cache_key = COLUMNS[name]
        results[name] = run_column(name, extra, work / f"cache_{cache_key}", work, args.steps)
        r = results[name]
        print(f"{name}: total {r['total_s']:.1f}s startup {r['startup_s']:.1f}s gen {r['generate_s']:.2f}s "
              f"train {r['train_s']:.2f}s sync {r['sync_s']:.3f}s steady {r['steady_step_s']:.3f}s", flush=True)
    eager = results.get("eager", {}).get("steady_step_s")
    for name, r in results.items():  # compile ROI against the measured eager step
        if eager and name != "eager" and r["steady_step_s"] < eager:
            r["break_even_steps"] = r["compile_s"] / (eager - r["steady_step_s"])
    Path(args.out).write_text(json.dumps({"device": next(iter(results.values()))["device"], "steps": args.steps,
                                          "results": results}, indent=2, default=str))
    names = list(results)
    print(f"\n| seconds ({args.steps} steps) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for key, label in ROWS + [("break_even_steps", "compile break-even (steps)")]:
        cells = [f"{results[n][key]:.2f}" if isinstance(results[n].get(key), int | float) else "-" for n in names]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
