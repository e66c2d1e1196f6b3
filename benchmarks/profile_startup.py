"""Where startup goes: the reference workload's GRPORun construction and warm-up under cProfile, in this process,
after timing the imports. Prints the startup split the run records, then the functions with the most cumulative
time (monorl's and torch's entry points), so "model load 5.7 s" becomes named calls.

  python benchmarks/profile_startup.py [--model-dir .models] [--backend none] [--top 30]

--model-dir holds qwen3-0.6b/config.json and qwen3-tokenizer/ (copied from ../shared/models, see bench_memory.py).
"""

from __future__ import annotations

import argparse
import time

T0 = time.perf_counter()
import torch  # noqa: E402

IMPORT_TORCH_S = time.perf_counter() - T0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=".models")
    ap.add_argument("--backend", default="none", help="compile.backend of the profiled run")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--only-warm-up", action="store_true",
                    help="profile the warm-up alone (GRPORun's construction runs unprofiled)")
    ap.add_argument("--no-warm-up", action="store_true", help="profile GRPORun's construction alone")
    args = ap.parse_args()

    import cProfile
    import pstats
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_memory import model_dir  # the benchmarks' shared model-directory helper

    t = time.perf_counter()
    from monorl.config import apply_overrides, preset
    from monorl.rl.loop import GRPORun

    import_monorl_s = time.perf_counter() - t
    work = Path(tempfile.mkdtemp(prefix="profile_startup_"))
    model = model_dir(Path(args.model_dir), "qwen3-0.6b")
    cfg = apply_overrides(preset("qwen3_0_6b_sum_digits"), {
        "model.path": str(model), "model.random_init": "true", "rollout.ignore_eos": "true",
        "checkpoint.final": "false", "checkpoint.every_minutes": "0", "compile.backend": args.backend,
        "run_dir": str(work / "run")})
    prof = cProfile.Profile()
    t = time.perf_counter()
    if args.only_warm_up:
        run = GRPORun(cfg, progress=False)
        t = time.perf_counter()
        prof.enable()
    else:
        prof.enable()
        run = GRPORun(cfg, progress=False)
    if not args.no_warm_up:
        run.warm_up()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    total = time.perf_counter() - t
    print(f"import torch {IMPORT_TORCH_S:.2f}s, import monorl.rl.loop {import_monorl_s:.2f}s, "
          f"{'warm_up' if args.only_warm_up else 'GRPORun' if args.no_warm_up else 'GRPORun + warm_up'} "
          f"{total:.2f}s (under cProfile)")
    print("startup split: " + ", ".join(f"{k}={v:.2f}" for k, v in run.startup.items()))
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats("monorl", args.top)  # monorl's own calls, by cumulative time
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
