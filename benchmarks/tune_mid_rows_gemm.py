"""Decode products at 65-256 rows (the throughput run's steps before its rows drop to 64: cuBLAS before 2026-11-26,
0.67 s of its 4.8 s of decode kernels on an H200) against `monorl.ops.decode_gemm`'s split-K kernel in a sweep of
tilings and against its kept launch (`split_k_parts`, where `split_k_fits`): program (column tile, K part, row tile)
writes its fp32 sums to parts [P, M, N] that the kernel reading the product next adds. Weights cold (another copy
each call, ~256 MB in turn). Prints cuBLAS, the kept launch, the best tiling and its config per (shape, rows), plus
the parts' extra bytes (P - 1) M N 4 that the consumer reads on top.

  python benchmarks/tune_mid_rows_gemm.py --rows 128,256 --out tune_mid_rows_gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
from triton.testing import do_bench_cudagraph

from monorl.ops import decode_gemm

SHAPES = {"0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate/up": (6144, 1024), "0.6b down": (1024, 3072),
          "0.6b lm head": (151936, 1024), "1.7b o": (2048, 2048), "1.7b down": (2048, 6144)}
COLD_BYTES = 256 << 20


def parts_product(x: torch.Tensor, w: torch.Tensor, parts: torch.Tensor, bm: int, bn: int, bk: int, P: int,
                  warps: int, stages: int) -> torch.Tensor:
    """`decode_gemm`'s split-K kernel in one tiling (BM x BN tiles, BK-wide K steps, P parts) into parts [P, M, N]."""
    M, K = x.shape
    N = w.shape[0]
    ks = triton.cdiv(triton.cdiv(K, P), bk) * bk
    decode_gemm._split_k_kernel[(triton.cdiv(N, bn), P, triton.cdiv(M, bm))](
        x, w, parts, M, N, K, ks, x.stride(0), w.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages)
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="128,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--kept-only", action="store_true", help="cuBLAS against the kept launch only (no sweep)")
    ap.add_argument("--out", default="tune_mid_rows_gemm.json")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {}
    print(f"device {torch.cuda.get_device_name()}; us per product, weights cold")
    print("| shape | rows | cuBLAS | kept launch (`decode_gemm.split_k_parts`, where it applies) | best parts kernel | "
          "its config (BM, BN, BK, P, warps, stages) | parts' extra MB |")
    print("|---|---|---|---|---|---|---|")
    configs = [(bm, bn, bk, P, 4 if bm == 64 else 8, 4)
               for bm, bn, bk, P in itertools.product((64, 128), (64, 128, 256), (64, 128), (1, 2, 4))]
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        ws = [(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
              for _ in range(max(1, COLD_BYTES // (N * K * 2)))]
        for M in map(int, a.rows.split(",")):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            ref = x.float() @ ws[0].float().t()
            cublas = do_bench_cudagraph(lambda x=x, ws=ws: [x @ w.t() for w in ws], rep=20) / len(ws) * 1e3
            kept = float("nan")
            if decode_gemm.split_k_fits(x, ws[0]):
                kept = do_bench_cudagraph(lambda x=x, ws=ws: [decode_gemm.split_k_parts(x, w) for w in ws],
                                          rep=20) / len(ws) * 1e3
            best = (float("inf"), None)
            for bm, bn, bk, P, warps, stages in [] if a.kept_only else configs:
                if (bn == 256 and bk == 128) or N // bn * P < 32:
                    continue
                parts = torch.empty(P, M, N, dtype=torch.float32, device="cuda")
                try:
                    parts_product(x, ws[0], parts, bm, bn, bk, P, warps, stages)
                    torch.testing.assert_close(parts.sum(0), ref, atol=2e-2, rtol=2e-2)
                    us = do_bench_cudagraph(lambda x=x, ws=ws, parts=parts, c=(bm, bn, bk, P, warps, stages): [
                        parts_product(x, w, parts, *c) for w in ws], rep=20) / len(ws) * 1e3
                except Exception as e:  # out of shared memory or registers
                    print(f"  skip {bm, bn, bk, P, warps, stages}: {type(e).__name__}", flush=True)
                    continue
                if us < best[0]:
                    best = (us, (bm, bn, bk, P, warps, stages))
            extra = (best[1][3] - 1) * M * N * 4 / 1e6 if best[1] else 0.0
            res[f"{name} {M}"] = {"cublas_us": cublas, "kept_us": kept, "parts_us": best[0], "config": best[1],
                                  "extra_mb": extra}
            print(f"| {name} | {M} | {cublas:.2f} | {kept:.2f} | {best[0]:.2f} | {best[1]} | {extra:.2f} |", flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
