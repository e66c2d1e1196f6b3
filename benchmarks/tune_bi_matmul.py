"""Tile sweep for the batch-invariant matmul (`monorl.ops.matmul_invariant`): for each linear shape of Qwen3-0.6B
and -1.7B (unfused and fused projections, LM head), every candidate tiling timed at M = 40 (a decode step of the
reference workload), 1024 (a prefill) and 8192 (a trainer pack), against cuBLAS. Score = 100 x t(40) + t(1024) +
t(8192), about what one RL step of the reference workload spends in that shape (100 decode steps, a prefill, a
forward pass). Timed in CUDA graphs. "current" is `_mm_config`'s pick per M (it may change tiles with M: see its
docstring).

A candidate is (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). `--cold`: each timed call reads another copy of the
weight, about 256 MB of copies in turn, as a decode step's 28 layers do; without it the one weight stays in L2
and a GEMV-sized product looks several times faster than it runs in a step.

  python benchmarks/tune_bi_matmul.py --out tune_bi_matmul.json
  python benchmarks/tune_bi_matmul.py --ms 40 --cold --block-k 128,256 --stages 3,4,5,6 --out decode.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.testing import do_bench_cudagraph

from monorl.ops import matmul_invariant as mi

SHAPES = {  # name: (N, K)
    "0.6b q": (2048, 1024), "0.6b kv": (1024, 1024), "0.6b o": (1024, 2048), "0.6b gate/up": (3072, 1024),
    "0.6b down": (1024, 3072), "0.6b qkv fused": (4096, 1024), "0.6b gate_up fused": (6144, 1024),
    "0.6b lm head": (151936, 1024),
    "1.7b q/o": (2048, 2048), "1.7b kv": (1024, 2048), "1.7b gate/up": (6144, 2048), "1.7b down": (2048, 6144),
    "1.7b qkv fused": (4096, 2048), "1.7b gate_up fused": (12288, 2048), "1.7b lm head": (151936, 2048),
}
WEIGHT = {40: 100, 1024: 1, 8192: 1}
COLD_BYTES = 256 << 20  # over 5x the H100's / H200's 50 MB L2


def bench(fn, calls: int) -> float:
    """ms per product, replayed from a CUDA graph as the decode step and the trainer run them: a plain launch of a
    Triton kernel costs more host time (~30 us) than a decode-sized GEMM takes on the GPU."""
    return do_bench_cudagraph(fn, rep=20) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_bi_matmul.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="40,1024,8192", help="row counts timed (scored with WEIGHT)")
    ap.add_argument("--block-m", default="64")
    ap.add_argument("--block-n", default="16,32,64,128")
    ap.add_argument("--block-k", default="64,128")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--warps", default="4", help="warps a program (the bitwise family is 4 warps per 64 rows)")
    ap.add_argument("--cold", action="store_true", help="every call reads another copy of the weight (HBM, not L2)")
    a = ap.parse_args()
    ints = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    ms = ints(a.ms)
    tilings = [(bm, bn, bk, nw, ns) for bm, bn, bk, nw, ns in
               itertools.product(ints(a.block_m), ints(a.block_n), ints(a.block_k), ints(a.warps), ints(a.stages))]
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    print(f"device {torch.cuda.get_device_name()}, cold={a.cold}; us per product", flush=True)
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        copies = max(1, COLD_BYTES // (N * K * 2)) if a.cold else 1
        ws = [torch.randn(N, K, device="cuda", generator=g).bfloat16() for _ in range(copies)]
        xs = {m: torch.randn(m, K, device="cuda", generator=g).bfloat16() for m in ms}

        def timed(product, m, xs=xs, ws=ws):
            return bench(lambda: [product(xs[m], w) for w in ws], len(ws)) * 1e3

        row = {"N": N, "K": K, "copies": copies, "cublas": {m: timed(lambda x, w: x @ w.t(), m) for m in ms},
               "current": {m: mi._mm_config(m, N, K) for m in ms}, "configs": {}}
        row["current_us"] = {m: timed(lambda x, w: mi._mm_triton(x, w), m) for m in ms}
        x200 = torch.randn(200, K, device="cuda", generator=g).bfloat16()
        decode = mi._mm_triton(x200, ws[0], mi._mm_config(40, N, K))  # the bitwise reference: a decode tiling
        row["bitwise"] = {}
        for cfg in tilings:
            try:
                t = {m: timed(lambda x, w, c=cfg: mi._mm_triton(x, w, c), m) for m in ms}
            except Exception as e:  # e.g. out of shared memory for this tile
                print(f"{name} {cfg}: {type(e).__name__}", flush=True)
                continue
            row["configs"][str(cfg)] = t
            row["bitwise"][str(cfg)] = torch.equal(mi._mm_triton(x200, ws[0], cfg), decode)
        score = {c: sum(WEIGHT.get(m, 1) * t[m] for m in ms) for c, t in row["configs"].items()}
        best = min(score, key=score.get)
        row["best"], row["score"] = best, score
        cb, cu, bt = row["cublas"], row["current_us"], row["configs"][best]
        fmt = lambda d: " ".join(f"{d[m]:.1f}" for m in ms)  # noqa: E731
        print(f"{name:20s} N={N:6d} K={K:5d} | cuBLAS {fmt(cb)} | current {fmt(cu)} | best {best} {fmt(bt)}",
              flush=True)
        for c in sorted(score, key=score.get)[:6]:
            print(f"    {c}: {fmt(row['configs'][c])}  bitwise the decode tiling: {row['bitwise'][c]}")
        res[name] = row
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
