"""Where a run's Triton JIT time goes: runs `monorl ARGS...` in this process with Triton's compile and its
per-signature C launcher (built with the host compiler on a cold cache) timed, then prints one row per kernel:
how many specialisations were compiled or loaded, the seconds in `triton.compile` and in launcher builds (summed
over threads where `monorl.speedups.precompile` compiled them ahead), and how many were compiled at their first launch
instead (outside its threads -- the main one, or autograd's for backward kernels: ones the ahead-of-time pass
missed, or all of them with it off).
Kernels Inductor generates go through the same two calls and are listed under their generated names.

  python benchmarks/trace_triton_jit.py train --preset qwen3_0_6b_sum_digits ...   (JSON: --trace-out FILE first)
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import defaultdict

import triton.compiler
from triton.backends.nvidia import driver as nvidia_driver

from monorl.speedups.precompile import COMPILE_THREADS

# compiles, compile s, launchers, launcher s, compiles at first launch (outside monorl's compile-ahead threads)
ROWS: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0, 0])


def _traced_compile(orig):
    def compile(src, *args, **kwargs):
        t = time.perf_counter()
        out = orig(src, *args, **kwargs)
        row = ROWS[getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")]
        row[0] += 1
        row[1] += time.perf_counter() - t
        row[4] += not threading.current_thread().name.startswith(COMPILE_THREADS)
        return out
    return compile


def _traced_launcher(orig_init):
    def __init__(self, src, metadata):
        t = time.perf_counter()
        orig_init(self, src, metadata)
        row = ROWS[getattr(getattr(src, "fn", None), "__name__", None) or getattr(metadata, "name", "?")]
        row[2] += 1
        row[3] += time.perf_counter() - t
    return __init__


def report() -> dict:
    rows = sorted(ROWS.items(), key=lambda kv: -(kv[1][1] + kv[1][3]))
    print("\n| kernel | compiles | compile s | launchers | launcher s | compiled at launch |")
    print("|---|---|---|---|---|---|")
    for name, (n, s, ln, ls, late) in rows:
        print(f"| {name[:48]} | {n} | {s:.2f} | {ln} | {ls:.2f} | {late} |")
    tot = [sum(r[i] for _, r in rows) for i in range(5)]
    print(f"| total | {tot[0]} | {tot[1]:.2f} | {tot[2]} | {tot[3]:.2f} | {tot[4]} |")
    keys = ("compiles", "compile_s", "launchers", "launcher_s", "compiled_at_launch")
    return {name: dict(zip(keys, r, strict=True)) for name, r in rows}


def main() -> int:
    argv = sys.argv[1:]
    out = None
    if argv[:1] == ["--trace-out"]:
        out, argv = argv[1], argv[2:]
    triton.compiler.compile = _traced_compile(triton.compiler.compile)
    nvidia_driver.CudaLauncher.__init__ = _traced_launcher(nvidia_driver.CudaLauncher.__init__)
    from monorl.cli import main as monorl_main

    rc = monorl_main(argv)
    rows = report()
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
