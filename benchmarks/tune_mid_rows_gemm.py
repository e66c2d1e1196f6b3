"""Decode products at 65-256 rows (the throughput run's steps before its rows drop to 64: cuBLAS today, 0.67 s of
its 4.8 s of decode kernels on an H200) against a Triton split-K candidate: program (row tile, column tile, K part)
writes its fp32 sums to parts [P, M, N] that the kernel reading the product next would add (as
`monorl.ops.decode_gemm` does up to 64 rows). Weights cold (another copy each call, ~256 MB in turn). The sweep
prints cuBLAS, the best candidate and its config per (shape, rows), plus the parts' extra bytes (P - 1) M N 4 that
the consumer reads on top.

  python benchmarks/tune_mid_rows_gemm.py --rows 128,256 --out tune_mid_rows_gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from monorl.ops import decode_gemm

SHAPES = {"0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate/up": (6144, 1024), "0.6b down": (1024, 3072),
          "0.6b lm head": (151936, 1024), "1.7b o": (2048, 2048), "1.7b down": (2048, 6144)}
COLD_BYTES = 256 << 20


@triton.jit(do_not_specialize=["M"])
def _parts_kernel(a_ptr, b_ptr, p_ptr, M, N, K, KS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(s * KS, tl.minimum(K, s * KS + KS), BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * K + kk[None, :], mask=offs_m[:, None] < M, other=0.0)
        b = tl.load(b_ptr + offs_n[:, None] * K + kk[None, :], mask=offs_n[:, None] < N, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(p_ptr + s * M * N + offs_m[:, None] * N + offs_n[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def parts_product(x: torch.Tensor, w: torch.Tensor, parts: torch.Tensor, bm: int, bn: int, bk: int, P: int,
                  warps: int, stages: int) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    ks = triton.cdiv(triton.cdiv(K, P), bk) * bk
    _parts_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), P)](x, w, parts, M, N, K, ks, BLOCK_M=bm, BLOCK_N=bn,
                                                               BLOCK_K=bk, num_warps=warps, num_stages=stages)
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
