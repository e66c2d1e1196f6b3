"""The generator's Triton sampler (`monorl.ops.sample_kernels.sample`) at decode shapes: [B, 151,936] bf16 logits,
temperature 0.8, top-p 0.95 (the reference preset's), temperature alone and greedy for comparison. Sweeps the launch
(logits a program walks, logits a loop iteration of the sampling pass and of the nucleus search's passes, warps) and
prints microseconds a call replayed from a CUDA graph (`do_bench_cudagraph`: the decode step's own setting). Every
launch's tokens are checked against the kept launch's (the nucleus threshold is an exact integer search, so they
must be equal; log-probs to fp32 rounding: the logsumexp's chunk order follows the launch).

  python benchmarks/tune_sampler.py --out tune_sampler.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.testing import do_bench_cudagraph

from monorl.ops import sample_kernels as sk
from monorl.ops.tunables import chip_of, overridden, tuned

LAUNCH = ("sampler.chunk", "sampler.block", "sampler.nucleus_block", "sampler.warps")  # what a launch sets

V = 151936


def logits_of(B: int, scale: float) -> torch.Tensor:
    """Normal logits times `scale`: 0.5 is nearly flat (a random-weight model's; the nucleus holds most of the
    vocabulary), 4 is peaked (a small nucleus)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(B, V, device="cuda", generator=g) * scale).bfloat16()


def time_us(x: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor, temperature: float, top_p: float) -> float:
    return do_bench_cudagraph(lambda: sk.sample(x, keys, pos, temperature, top_p)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="40,128")
    ap.add_argument("--scales", default="0.5,4")
    ap.add_argument("--chunks", default="8192,16384")
    ap.add_argument("--blocks", default="1024,2048,4096")
    ap.add_argument("--nucleus-blocks", default="1024,2048")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kept = tuple(tuned(name, chip_of(0)) for name in LAUNCH)
    launches = [kept] + [c for c in itertools.product(*(map(int, v.split(",")) for v in
                                                          (args.chunks, args.blocks, args.nucleus_blocks, args.warps)))
                         if c != kept and max(c[1], c[2]) <= c[0]]
    results = {}
    for B, scale in itertools.product(map(int, args.rows.split(",")), map(float, args.scales.split(","))):
        x = logits_of(B, scale)
        keys = torch.arange(B, device="cuda", dtype=torch.int64) * 7919
        pos = torch.full((B,), 200, device="cuda", dtype=torch.int64)
        name = f"{B} rows, scale {scale}"
        row = {}
        ref = None
        for launch in launches:
            with overridden(dict(zip(LAUNCH, launch, strict=True))):
                tok, lp = sk.sample(x, keys, pos, 0.8, 0.95)
                if ref is None:
                    ref = (tok, lp)
                assert torch.equal(tok, ref[0]), f"{name} {launch}: tokens differ from the kept launch's"
                torch.testing.assert_close(lp, ref[1], rtol=0, atol=1e-4)
                nucleus, plain, greedy = (time_us(x, keys, pos, t, p)
                                          for t, p in ((0.8, 0.95), (0.8, 1.0), (0.0, 1.0)))
            row[str(launch)] = {"top_p": nucleus, "no_top_p": plain, "greedy": greedy}
            print(f"{name} | {launch} | top-p {nucleus:7.1f} us | "
                  f"T only {plain:6.1f} | greedy {greedy:6.1f}", flush=True)
        results[name] = row
    print("\n| shape | kept (top-p / T only / greedy us) | best top-p | its launch |\n|---|---|---|---|")
    for name, row in results.items():
        k = row[str(kept)]
        best = min(row, key=lambda c: row[c]["top_p"])
        print(f"| {name} | {k['top_p']:.1f} / {k['no_top_p']:.1f} / {k['greedy']:.1f} | {row[best]['top_p']:.1f} | "
              f"{best} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "kept": kept, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
