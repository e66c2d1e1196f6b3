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
  nocompile_graphs   no compile; decode and trainer CUDA graphs (what a cold cache makes worth it)
  nocompile_graphs_eager_ops  the same with the generator's fused Triton kernels off (GeneratorConfig.fused_kernels)
  preset_auto        the preset's own settings (compile.backend auto, batch-invariant mode on), on a fresh cache
  bi_graphs, bi_nocompile_graphs  graphs / nocompile_graphs with batch-invariant mode on

Every column but preset_auto and the bi_ ones runs with batch-invariant mode off (`--batch_invariant false`;
the Qwen3 presets turn it on), so they stay the default-kernel baseline the mode's cost is measured against.

With --model-dir DIR (holding qwen3-0.6b/config.json and qwen3-tokenizer/, copied from ../shared/models into the
ignored .models/), the model is `--model.path` of that config + the real Qwen3 tokenizer with random_init, so
prompts are ~150 tokens as in a real run; without it, `--model.shape qwen3-0.6b` and the char tokenizer.

Rows: whole-process wall time (what the user waits for: interpreter, imports, startup, validation, steps), total
(startup + steps), startup and its split, generator, trainer, weight sync; plus the steady-state step.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import model_dir  # noqa: E402 -- the benchmarks' shared model-directory helper

BASE = ["--preset", "qwen3_0_6b_sum_digits", "--rollout.ignore_eos", "true", "--checkpoint.final", "false",
        "--checkpoint.every_minutes", "0"]

NO_TRAINER_GRAPHS = ["--compile.trainer_cuda_graphs", "false"]
COLUMNS = {
    "eager": (["--compile.backend", "none", "--compile.decode_cuda_graphs", "false", *NO_TRAINER_GRAPHS], "eager"),
    "compiled_gen": (["--compile.backend", "inductor", "--compile.trainer", "false", *NO_TRAINER_GRAPHS], "gen"),
    "compiled_all": (["--compile.backend", "inductor", *NO_TRAINER_GRAPHS], "all"),
    "compiled_all_warm": (["--compile.backend", "inductor", *NO_TRAINER_GRAPHS], "all"),  # same cache dir: warm
    "graphs": (["--compile.backend", "inductor", "--compile.trainer_cuda_graphs", "true"], "graphs"),
    "graphs_warm": (["--compile.backend", "inductor", "--compile.trainer_cuda_graphs", "true"], "graphs"),
    "nocompile_graphs": (["--compile.backend", "none", "--compile.trainer_cuda_graphs", "true"], "none"),
    # the generator on the model's eager ops and the PyTorch sampler instead of its fused Triton kernels
    "nocompile_graphs_eager_ops": (["--compile.backend", "none", "--compile.trainer_cuda_graphs", "true",
                                    "--generator.fused_kernels", "false"], "none"),
    "preset_auto": ([], "auto"),  # the preset as a user runs it: compile.backend auto decides
    # batch-invariant mode (issue 14's cost in the loop): the same settings as graphs / nocompile_graphs
    "bi_graphs": (["--batch_invariant", "true", "--compile.backend", "inductor", "--compile.trainer_cuda_graphs",
                   "true"], "bi"),
    "bi_nocompile_graphs": (["--batch_invariant", "true", "--compile.backend", "none",
                             "--compile.trainer_cuda_graphs", "true"], "none"),
}
STARTUP_KEYS = ("cuda_init_s", "prepare_s", "model_load_s", "generator_init_s", "trainer_compile_s",
                "trainer_graph_capture_s", "kv_alloc_s", "generator_compile_s", "graph_capture_s")

ROWS = [("process_wall_s", "process wall"), ("total_s", "total"), ("startup_s", "startup"),
        ("generate_s", "generator"), ("train_s", "trainer"),
        ("sync_s", "weight sync"), ("steady_step_s", "steady-state step"), ("compile_s", "compile (in startup)")]


def model_args(models: str | None, size: str = "0.6b") -> list[str]:
    """--model.path of a folder with Qwen3-<size>'s config.json and the real tokenizer (random init), or the
    shape."""
    if models is None:
        return ["--model.shape", f"qwen3-{size}"]
    return ["--model.path", str(model_dir(Path(models), f"qwen3-{size}")), "--model.random_init", "true"]


def run_column(name: str, extra: list[str], cache: Path, workdir: Path, steps: int, model: list[str]) -> dict:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "monorl.cli", "train", *BASE, *model, *extra, "--steps", str(steps),
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
    out.update({f"startup/{k}": v for k, v in out["startup"].items()})
    out["summary_lines"] = [ln for ln in log.splitlines() if ln.startswith(("startup", "compile:", "  Pre", "  Post"))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="rl_loop_results.json")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--columns", default=",".join(COLUMNS))
    ap.add_argument("--model-dir", default=None, help="qwen3-<size>/config.json + qwen3-tokenizer/ (e.g. .models)")
    ap.add_argument("--size", default="0.6b", help="the preset's workload on Qwen3-<size> (e.g. 1.7b)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    model = model_args(args.model_dir, args.size)
    results = {}
    for name in args.columns.split(","):
        extra, cache_key = COLUMNS[name]
        if name != "preset_auto" and not name.startswith("bi_"):
            extra = [*extra, "--batch_invariant", "false"]
        results[name] = run_column(name, extra, work / f"cache_{cache_key}", work, args.steps, model)
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
    startup_rows = [(f"startup/{k}", f"  {k[:-2]}") for k in STARTUP_KEYS]
    for key, label in ROWS[:3] + startup_rows + ROWS[3:] + [("break_even_steps", "compile break-even (steps)")]:
        cells = [f"{results[n][key]:.2f}" if isinstance(results[n].get(key), int | float) else "-" for n in names]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
