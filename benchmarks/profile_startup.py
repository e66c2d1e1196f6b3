"""Where startup goes: the reference workload's GRPORun construction and warm-up under cProfile, in this process,
after timing the imports. Prints the startup split the run records, then the functions with the most cumulative
time (monorl's and torch's entry points), so "model load 5.7 s" becomes named calls.

  python benchmarks/profile_startup.py [--model-dir .models] [--backend none] [--top 30]
  python benchmarks/profile_startup.py --preset smollm2_135m_arith --set model.path=FILE.gguf [--no-warm-up]

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
    ap.add_argument("--preset", default="qwen3_0_6b_sum_digits",
                    help="the run's preset; another than W0's takes its weights from --set model.path=...")
    ap.add_argument("--set", nargs="*", default=[], help="more config overrides, key=value")
    ap.add_argument("--only-warm-up", action="store_true",
                    help="profile the warm-up alone (GRPORun's construction runs unprofiled)")
    ap.add_argument("--no-warm-up", action="store_true", help="profile GRPORun's construction alone")
    ap.add_argument("--launches", action="store_true",
                    help="the warm-up alone under torch.profiler instead: its slow kernel launches (a first launch "
                         "loads the kernel's module), by kernel and the op that launched it")
    args = ap.parse_args()
    if args.launches:
        return slow_launches(args)

    import cProfile
    import pstats

    import monorl.cliargs  # noqa: F401  the command line's parser: not part of the import timed below

    t = time.perf_counter()
    from monorl.run.grpo import GRPORun

    import_monorl_s = time.perf_counter() - t
    cfg, _ = _preset_config(args)
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
    print(f"import torch {IMPORT_TORCH_S:.2f}s, import monorl.run.grpo {import_monorl_s:.2f}s, "
          f"{'warm_up' if args.only_warm_up else 'GRPORun' if args.no_warm_up else 'GRPORun + warm_up'} "
          f"{total:.2f}s (under cProfile)")
    print("startup split: " + ", ".join(f"{k}={v:.2f}" for k, v in run.startup.items()))
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats("monorl", args.top)  # monorl's own calls, by cumulative time
    stats.sort_stats("tottime").print_stats(args.top)


def _preset_config(args: argparse.Namespace):
    """(the profiled run's config, its work directory): W0's preset with random weights and EOS ignored, or
    another preset as it is (its weights from --set model.path=...); no checkpoints either way."""
    import sys
    import tempfile
    from pathlib import Path

    from monorl.cliargs import run_config

    work = Path(tempfile.mkdtemp(prefix="profile_startup_"))
    w0 = {}
    if args.preset == "qwen3_0_6b_sum_digits":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_memory import model_dir  # the benchmarks' shared model-directory helper

        w0 = {"model.path": str(model_dir(Path(args.model_dir), "qwen3-0.6b")), "model.random_init": "true",
              "rollout.ignore_eos": "true"}
    cfg = run_config(args.preset, {
        **w0, "checkpoint.final": "false", "checkpoint.every_minutes": "0", "compile.backend": args.backend,
        "run_dir": str(work / "run"), **dict(kv.split("=", 1) for kv in args.set)})
    return cfg, work


def _preset_run(args: argparse.Namespace):
    from monorl.run.grpo import GRPORun

    cfg, work = _preset_config(args)
    return GRPORun(cfg, progress=False), work


def slow_launches(args: argparse.Namespace, slow_ms: float = 1.0) -> None:
    """The warm-up's kernel launches that took over `slow_ms` on the host (CUDA's lazy loading: a kernel's first
    launch loads its module), each with its kernel and the innermost op around it; then their sum."""
    import json
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    run, work = _preset_run(args)
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run.warm_up()
        torch.cuda.synchronize()
    total = time.perf_counter() - t
    trace = work / "warm_up_trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = {e["args"].get("correlation"): e["name"] for e in events
               if e.get("cat") == "kernel" and "args" in e}
    ops = defaultdict(list)  # tid -> cpu ops (start, end, name)
    for e in events:
        if e.get("cat") == "cpu_op" and "dur" in e:
            ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    rows = []
    for e in events:
        if e.get("cat") == "cuda_runtime" and "Launch" in e["name"] and e.get("dur", 0) > slow_ms * 1e3:
            around = [o for o in ops[e["tid"]] if o[0] <= e["ts"] and e["ts"] + e["dur"] <= o[1]]
            op = min(around, key=lambda o: o[1] - o[0])[2] if around else "?"
            rows.append((e["dur"] / 1e3, kernels.get(e["args"].get("correlation"), "?"), op))
    rows.sort(reverse=True)
    print(f"warm-up {total:.2f} s under torch.profiler; launches over {slow_ms} ms: {len(rows)}, "
          f"{sum(r[0] for r in rows):.0f} ms in all")
    for ms, kernel, op in rows[: args.top]:
        print(f"{ms:8.1f} ms  {op[:40]:<40}  {kernel[:110]}")
    api: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # CUDA runtime / driver calls by name
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            api[e["name"]][0] += 1
            api[e["name"]][1] += e["dur"] / 1e3
    print("CUDA API calls by total time: " + ", ".join(
        f"{n} {c}x {ms:.0f} ms" for n, (c, ms) in sorted(api.items(), key=lambda kv: -kv[1][1])[:12]))
    gpu_ms = sum(e["dur"] for e in events if e.get("cat") == "kernel") / 1e3
    print(f"GPU kernel time {gpu_ms:.0f} ms")
    # the longest ops that ran outside any other op (the warm-up's own calls into torch), with their share
    # spent in CUDA API calls
    for tid, lst in ops.items():
        lst.sort(key=lambda o: (o[0], -o[1]))
        top, end = [], -1.0
        for o in lst:
            if o[0] >= end:
                top.append(o)
                end = o[1]
        if len(top) < 50:
            continue
        print(f"thread {tid}: {len(top)} top-level ops, {sum(o[1] - o[0] for o in top) / 1e3:.0f} ms")
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for o in top:
            by_name[o[2]][0] += 1
            by_name[o[2]][1] += (o[1] - o[0]) / 1e3
            by_name[o[2]][2] = max(by_name[o[2]][2], (o[1] - o[0]) / 1e3)
        for n, (c, ms, mx) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"  {ms:8.1f} ms {c:5d}x (max {mx:6.1f})  {n[:100]}")


if __name__ == "__main__":
    main()
