"""The RMS-norm backward (`monorl.ops.rmsnorm_invariant.rms_norm_backward`: the kernel and the weight gradient's
sum of partials) at the trainer's shapes of the reference workload: Qwen3-0.6B, a pack of 9,216 tokens -- the
layer norms (rows of 1024, with and without the residual's gradient) and the q/k norms (rows of 128, RoPE's
gradient folded in). Sweeps the launch (elements a half-row tile holds, warps, programs an SM) and prints
microseconds a call, replayed in a CUDA graph (`do_bench_cudagraph`), against the bytes' time at the device's
bandwidth. Every launch's gradients are checked against the default launch's to fp32 rounding, and the
default's twice in a row bitwise (deterministic).

  python benchmarks/tune_rms_backward.py --out tune_rms_backward.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json

import torch
from triton.testing import do_bench_cudagraph

from monorl.ops import rmsnorm_invariant as rn

# what a launch sets (ops/tunables.py)
LAUNCH = ("rmsnorm.backward_tile_elements", "rmsnorm.backward_warps", "rmsnorm.backward_programs_per_sm")

SHAPES = {  # name: (rows of tokens, heads, D, residual, rope)
    "layer norm + residual (1024)": (9216, 1, 1024, True, False),
    "layer norm (1024)": (9216, 1, 1024, False, False),
    "q norm + RoPE (16 x 128)": (9216, 16, 128, False, True),
    "k norm + RoPE (8 x 128)": (9216, 8, 128, False, True),
}


def inputs(T: int, H: int, D: int, res: bool, rope: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H * D, device="cuda", generator=g).bfloat16()
    return {"x": x, "w": torch.randn(D, device="cuda", generator=g).bfloat16(),
            "grad": torch.randn((T, H, D) if rope else (T, H * D), device="cuda", generator=g).bfloat16(),
            "grad_residual": torch.randn(T, H * D, device="cuda", generator=g).bfloat16() if res else None,
            "rope": (torch.randn(T, D, device="cuda", generator=g).bfloat16(),
                     torch.randn(T, D, device="cuda", generator=g).bfloat16()) if rope else None}


def bytes_moved(a: dict) -> int:
    n = a["x"].numel() * 2 * 3  # read x and grad, write x's gradient
    n += a["grad_residual"].numel() * 2 if a["grad_residual"] is not None else 0
    n += sum(t.numel() * 2 for t in a["rope"]) if a["rope"] is not None else 0
    return n


def run(a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return rn.rms_norm_backward(a["x"], a["w"], a["grad"], 1e-6, grad_residual=a["grad_residual"], rope=a["rope"])


def time_us(a: dict) -> float:
    """GPU time of a call replayed from a CUDA graph, as the trainer's graph runs it: timed eagerly, the custom
    op's host dispatch (~150 us) hid the kernels (the first sweep, 2026-11-25)."""
    return do_bench_cudagraph(lambda: run(a)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", default="1024,2048,4096")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--per-sm", default="1,2,4")
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s for the floor column")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:  # an older tree (PYTHONPATH=.base/src) has no table: its launch alone
        from monorl.ops.tunables import chip_of, overridden, tuned
        default = tuple(tuned(name, chip_of(0)) for name in LAUNCH)
        tunable = True
    except ImportError:
        tunable, default = False, "fixed"
    launches = list(itertools.product(*(map(int, v.split(",")) for v in (args.elements, args.warps, args.per_sm))))
    launches = launches if tunable else [default]
    results = {}
    for name, shape in SHAPES.items():
        a = inputs(*shape)
        ref = run(a)
        again = run(a)
        assert all(torch.equal(p, q) for p, q in zip(ref, again, strict=True)), f"{name}: not deterministic"
        floor = bytes_moved(a) / args.bandwidth * 1e6
        row = {"floor_us": floor, "us": {}}
        for launch in launches:
            with overridden(dict(zip(LAUNCH, launch, strict=True))) if tunable else contextlib.nullcontext():
                gx, gw = run(a)
                torch.testing.assert_close(gx.float(), ref[0].float(), atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(gw.float(), ref[1].float(), atol=1e-1, rtol=2e-2)
                row["us"][str(launch)] = time_us(a)
        results[name] = row
    cols = [str(c) for c in launches]
    print(f"\nus a call (elements, warps, programs an SM); default {default}\n")
    print("| shape | floor | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for name, row in results.items():
        print(f"| {name} | {row['floor_us']:.1f} | " + " | ".join(f"{row['us'][c]:.1f}" for c in cols) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "default": default, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
