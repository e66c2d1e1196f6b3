"""Tile sweep for the batch-invariant matmul (`monorl.ops.matmul_invariant`): for each linear shape of Qwen3-0.6B
and -1.7B (unfused and fused projections, LM head), every candidate tiling timed at M = 40 (a decode step of the
reference workload), 1024 (a prefill) and 8192 (a trainer pack), against cuBLAS. A tiling may depend on (N, K)
only, never on M: that is what keeps rows invariant. Score = 100 x t(40) + t(1024) + t(8192), about what one RL
step of the reference workload spends in that shape (100 decode steps, a prefill, a forward pass). Timed in CUDA graphs.
"current" is `_mm_config`'s pick per M (it may change tiles with M: see its docstring).

  python benchmarks/tune_bi_matmul.py --out tune_bi_matmul.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
from triton.testing import do_bench_cudagraph

from monorl.ops import matmul_invariant as mi

SHAPES = {  # name: (N, K)
    "0.6b q": (2048, 1024), "0.6b kv": (1024, 1024), "0.6b o": (1024, 2048), "0.6b gate/up": (3072, 1024),
    "0.6b down": (1024, 3072), "0.6b qkv fused": (4096, 1024), "0.6b gate_up fused": (6144, 1024),
    "0.6b lm head": (151936, 1024),
    "1.7b q/o": (2048, 2048), "1.7b kv": (1024, 2048), "1.7b gate/up": (6144, 2048), "1.7b down": (2048, 6144),
    "1.7b lm head": (151936, 2048),
}
MS = (40, 1024, 8192)
WEIGHT = {40: 100, 1024: 1, 8192: 1}
CONFIGS = [(bm, bn, bk, 4, ns) for bm, bn, bk, ns in itertools.product((32, 64), (16, 32, 64, 128), (64, 128), (3, 4))]


def bench(fn) -> float:
    """ms per call, replayed from a CUDA graph as the decode step and the trainer run them: a plain launch of a
    Triton kernel costs more host time (~30 us) than a decode-sized GEMM takes on the GPU."""
    return do_bench_cudagraph(fn, rep=20)


def run(x: torch.Tensor, w: torch.Tensor, cfg: tuple) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm, bn, bk, nw, ns = cfg
    mi._mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_bi_matmul.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="40,1024,8192", help="row counts timed (scored with WEIGHT)")
    ap.add_argument("--block-m", default="32,64")
    ap.add_argument("--block-k", default="64,128")
    ap.add_argument("--stages", default="3,4")
    a = ap.parse_args()
    global MS, CONFIGS
    ints = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    MS = ints(a.ms)
    CONFIGS = [(bm, bn, bk, 4, ns) for bm, bn, bk, ns in
               itertools.product(ints(a.block_m), (16, 32, 64, 128), ints(a.block_k), ints(a.stages))]
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16()
        xs = {m: torch.randn(m, K, device="cuda", generator=g).bfloat16() for m in MS}
        row = {"N": N, "K": K, "cublas": {m: bench(lambda x=xs[m], w=w: x @ w.t()) for m in MS},
               "current": {m: mi._mm_config(m, N, K) for m in MS}, "configs": {}}
        for cfg in CONFIGS:
            try:
                t = {m: bench(lambda x=xs[m], w=w, c=cfg: run(x, w, c)) for m in MS}
            except Exception as e:  # e.g. out of shared memory for this tile
                print(f"{name} {cfg}: {type(e).__name__}", flush=True)
                continue
            row["configs"][str(cfg)] = t
        score = {c: sum(WEIGHT[m] * t[m] for m in MS) for c, t in row["configs"].items()}
        best = min(score, key=score.get)
        row["best"], row["score"] = best, score
        cur_score = sum(WEIGHT[m] * row["configs"][str(c)][m] for m, c in row["current"].items()
                        if str(c) in row["configs"])
        cb, bt = row["cublas"], row["configs"][best]
        print(f"{name:20s} N={N:6d} K={K:5d} | cuBLAS {' '.join(f'{cb[m] * 1e3:.1f}' for m in MS)} us"
              f" | current (by M) {cur_score*1e3:8.0f} | best {best} {score[best]*1e3:8.0f} "
              f"({' '.join(f'{bt[m] * 1e3:.1f}' for m in MS)} us)", flush=True)
        res[name] = row
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    # one tiling for every shape of a K (what fused projections need): the best total score per K
    print("\n| K | best config over that K's shapes (not LM heads) | total score us | current total |")
    print("|---|---|---|---|")
    for K in sorted({r["K"] for r in res.values()}):
        rows = [r for n, r in res.items() if r["K"] == K and "lm head" not in n]
        if not rows:
            continue
        common = set.intersection(*(set(r["score"]) for r in rows))
        tot = {c: sum(r["score"][c] for r in rows) for c in common}
        best = min(tot, key=tot.get)
        cur = sum(WEIGHT[m] * r["configs"][str(c)][m] for r in rows for m, c in r["current"].items()
                  if str(c) in r["configs"])
        print(f"| {K} | {best} | {tot[best]*1e3:.0f} | {cur*1e3:.0f} |")


if __name__ == "__main__":
    main()
