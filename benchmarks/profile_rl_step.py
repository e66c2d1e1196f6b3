"""Where one steady-state RL step of the reference workload goes, GPU against host: the preset's GRPORun (random
weights, real tokenizer, EOS ignored) warmed up, a few steps run, then steps profiled with torch.profiler. For
each profiled step: its wall time, the GPU's busy time (the union of its kernels' intervals), and the idle gaps
longer than --gap-ms with the monorl phase the host was in (`record_function` ranges around the loop's phases)
and the kernels on either side. A step's time the GPU sits idle is host time no kernel work hides.

  python benchmarks/profile_rl_step.py [--model-dir .models] [--steps 6] [--profile 2] [--out rl_step.json]
  python benchmarks/profile_rl_step.py --preset smollm2_135m_arith --set model.path=FILE.gguf
  python benchmarks/profile_rl_step.py --set model.shape=qwen3_5-0.8b --steps 3 --profile 1   # #58's hybrid

Under torchrun (`torchrun --standalone --nproc_per_node 4 benchmarks/profile_rl_step.py ...`) every rank runs the
FSDP step and profiles its own; each writes --out with `.rankN` before the suffix, and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _phases(run) -> None:
    """Wrap the loop's phases in record_function ranges (instance attributes: the class stays untouched)."""
    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:  # a piece this tree does not have (the list outlives refactors)
            return

        def wrapped(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        setattr(obj, name, wrapped)

    wrap(run.producer, "produce", "phase:rollouts")
    wrap(run.generator, "generate", "phase:generate")
    wrap(run.trainer, "step", "phase:trainer.step")
    wrap(run.trainer, "_my_micro_batches", "phase:pack")
    wrap(run.trainer, "_apply_gradients", "phase:optimizer")
    wrap(run.trainer, "_reduce_metrics", "phase:metrics_sync")
    wrap(run.consumer, "publish", "phase:sync_weights")
    # finer host pieces, for what lies inside an idle gap (the table's "host pieces")
    import monorl.rl.consumer as consumer_mod
    import monorl.rl.rollouts.producer as producer_mod
    import monorl.rl.rollouts.rollout as rollouts_mod
    import monorl.train.trainer as trainer_mod

    pieces = [(run.generator, "_admit"), (run.generator, "_reap"), (run.generator, "_completion"),
              (run.generator.runner, "read_ring"), (run.generator.runner, "prefill"),
              (run.generator.runner, "reset_slots"), (run.generator.runner, "set_slots"),
              (run.generator.cache, "copy_blocks"), (run.producer, "check_rewards"), (run.trainer, "_ensure_graph"),
              (rollouts_mod, "encode_prompts"), (producer_mod, "encode_prompts"), (rollouts_mod, "safe_score_batch"),
              (rollouts_mod, "gather_groups"),
              (consumer_mod, "assign_advantages"), (trainer_mod.LossNorm, "for_step")]
    if run.trainer.graphs is not None:
        pieces.append((run.trainer.graphs, "install_grads"))
    for obj, name in pieces:
        wrap(obj, name, f"phase:{name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=".models")
    ap.add_argument("--preset", default="qwen3_0_6b_sum_digits",
                    help="the run's preset; another than W0's takes its weights from --set model.path=...")
    ap.add_argument("--steps", type=int, default=6, help="steps run before the profiled ones")
    ap.add_argument("--profile", type=int, default=2, help="steps profiled")
    ap.add_argument("--gap-ms", type=float, default=0.5, help="idle gaps listed from this length")
    ap.add_argument("--out", default="rl_step.json")
    ap.add_argument("--kernels", type=int, default=14, help="kernels listed by GPU time, generation and the rest")
    ap.add_argument("--trace", default="", help="write the first profiled step's Chrome trace here (gzipped)")
    ap.add_argument("--set", nargs="*", default=[], help="more config overrides, key=value")
    ap.add_argument("--no-fla", action="store_true",
                    help="Qwen3.5's layers on monorl's references and the plain decode path (the two switches "
                         "monorl.ops.gated_delta.FLA_ENABLED and gated_delta_decode.ENABLED, on by default, off)")
    ap.add_argument("--cprofile", action="store_true",
                    help="also run the profiled steps' count once more under cProfile: the host's functions")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_memory import model_dir  # the benchmarks' shared model-directory helper

    from monorl.cliargs import run_config
    from monorl.run.grpo import GRPORun

    if args.no_fla:
        from monorl.ops import gated_delta, gated_delta_decode
        gated_delta.FLA_ENABLED = gated_delta_decode.ENABLED = False
    work = Path(tempfile.mkdtemp(prefix="profile_rl_step_"))
    shaped = any(kv.startswith("model.shape=") for kv in args.set)  # a named shape: random weights, char tokenizer
    w0 = {"model.random_init": "true", "rollout.ignore_eos": "true"} if args.preset == "qwen3_0_6b_sum_digits" \
        else {"validation.num_prompts": "0"}
    if args.preset == "qwen3_0_6b_sum_digits" and not shaped:
        w0["model.path"] = str(model_dir(Path(args.model_dir), "qwen3-0.6b"))
    cfg = run_config(args.preset, {
        **w0, "checkpoint.final": "false", "checkpoint.every_minutes": "0",
        "steps": str(args.steps + args.profile * (2 if args.cprofile else 1) + 1), "run_dir": str(work / "run"),
        **dict(kv.split("=", 1) for kv in args.set)})
    run = GRPORun(cfg, progress=False)
    run.warm_up()
    for s in range(args.steps):
        run.step(s)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    _phases(run)
    rows = []
    for s in range(args.steps, args.steps + args.profile):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            with record_function("phase:step"):
                m = run.step(s)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
        if args.trace and s == args.steps:
            import gzip
            import shutil
            raw = Path(args.trace).with_suffix("")
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(args.trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
        events = prof.events()
        # GPU work only: a record_function range also shows on the GPU's timeline (a user annotation spanning the
        # kernels of its phase), which counted as busy time and as a kernel hid every gap inside it
        kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events
                          if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                          and not getattr(e, "is_user_annotation", False) and not e.name.startswith("phase:")
                          and not e.name.startswith("Optimizer.")),
                         key=lambda k: k[0])
        phases = [(e.time_range.start, e.time_range.end, e.name[6:]) for e in events
                  if e.name.startswith("phase:") and e.device_type == torch.autograd.DeviceType.CPU]
        step_rng = next((a, b) for a, b, n in phases if n == "step")
        busy = _union_us([(a, b) for a, b, _ in kernels])
        gaps, end, prev = [], step_rng[0], "(step start)"
        for a, b, name in kernels + [(step_rng[1], step_rng[1], "(step end)")]:
            if a - end >= args.gap_ms * 1000:
                # the innermost phase holding the whole gap, and the phases the gap overlaps
                holding = [(pb - pa, n) for pa, pb, n in phases if pa <= end and pb >= a and n != "step"]
                host = min(holding)[1] if holding else "loop"
                inner = sorted({n for pa, pb, n in phases if pa < a and pb > end and n != "step"})
                # host pieces overlapping the gap (not those holding all of it), by time within it
                pieces: dict[str, float] = {}
                for pa, pb, n in phases:
                    if n != "step" and not (pa <= end and pb >= a) and min(pb, a) > max(pa, end):
                        pieces[n] = pieces.get(n, 0.0) + (min(pb, a) - max(pa, end)) / 1000
                gaps.append({"at_ms": (end - step_rng[0]) / 1000, "ms": (a - end) / 1000, "host": host,
                             "inside": inner, "after": prev[:48], "before": name[:48],
                             "pieces_ms": dict(sorted(pieces.items(), key=lambda kv: -kv[1]))})
            if b > end:
                end, prev = b, name
        phase_ms: dict[str, float] = {}
        phase_gpu_ms: dict[str, float] = {}  # the GPU's busy time inside each phase's host spans
        for a, b, n in phases:
            phase_ms[n] = phase_ms.get(n, 0.0) + (b - a) / 1000
            inside = [(max(ka, a), min(kb, b)) for ka, kb, _ in kernels if kb > a and ka < b]
            phase_gpu_ms[n] = phase_gpu_ms.get(n, 0.0) + _union_us(inside) / 1000
        # GPU time by kernel name, generation against the rest: a generation ends with a host read of its tokens,
        # so its kernels all start before the host's generate phase ends
        gen_end = max((b for a, b, n in phases if n == "generate"), default=step_rng[0])
        by_kernel: dict[str, dict[str, list[float]]] = {"generate": {}, "rest": {}}
        for a, b, name in kernels:
            part = by_kernel["generate" if a < gen_end else "rest"].setdefault(name[:72], [0, 0.0])
            part[0] += 1
            part[1] += (b - a) / 1000
        rows.append({"step": s + 1, "wall_s": wall, "gpu_busy_s": busy / 1e6, "kernels": len(kernels),
                     "loop_times_s": {k[5:]: v for k, v in m.items() if k.startswith("time/")},
                     "phases_ms": phase_ms, "phase_gpu_busy_ms": phase_gpu_ms,
                     "gaps": sorted(gaps, key=lambda g: -g["ms"])[:15],
                     "kernels_ms": {k: dict(sorted(v.items(), key=lambda kv: -kv[1][1]))
                                    for k, v in by_kernel.items()}})
    if args.cprofile:  # the host's side of the same steps: where a step's host time goes, function by function
        import cProfile
        import pstats

        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for s in range(args.steps + args.profile, args.steps + 2 * args.profile):
            run.step(s)
        prof.disable()
        print(f"\ncProfile of {args.profile} steps ({time.perf_counter() - t:.3f} s); GPU waits show as "
              "tolist/item/synchronize/replay")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    if run.world.size > 1:
        out = out.with_suffix(f".rank{run.world.rank}{out.suffix}")
    out.write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    for r in rows if run.world.is_main else []:
        idle = r["wall_s"] - r["gpu_busy_s"]
        print(f"\nstep {r['step']}: wall {r['wall_s'] * 1e3:.1f} ms, GPU busy {r['gpu_busy_s'] * 1e3:.1f} ms, "
              f"idle {idle * 1e3:.1f} ms, {r['kernels']} kernels")
        print("loop's times (s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["loop_times_s"].items()))
        print("phases (host ms): " + ", ".join(f"{k} {v:.1f}" for k, v in r["phases_ms"].items()))
        print("GPU busy inside each phase (ms): " + ", ".join(
            f"{k} {v:.1f}" for k, v in r["phase_gpu_busy_ms"].items()))
        print("| at ms | idle ms | host phase | phases overlapped | after kernel | before kernel |")
        print("|---|---|---|---|---|---|")
        for g in r["gaps"]:
            print(f"| {g['at_ms']:.1f} | {g['ms']:.2f} | {g['host']} | {' '.join(g['inside'])} | {g['after']} "
                  f"| {g['before']} |")
        for part, names in r["kernels_ms"].items():
            total = sum(v[1] for v in names.values())
            print(f"GPU time, {part}: {total:.1f} ms in {sum(v[0] for v in names.values())} kernels; "
                  f"top {args.kernels} (calls, ms, us a call):")
            for name, (n, ms) in list(names.items())[:args.kernels]:
                print(f"  {n:6d} {ms:8.2f} {ms * 1e3 / n:8.1f}  {name}")
        for g in r["gaps"][:3]:
            print(f"host pieces of the {g['ms']:.2f} ms gap at {g['at_ms']:.1f} ms: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in g["pieces_ms"].items() if v >= 0.05))


if __name__ == "__main__":
    main()
