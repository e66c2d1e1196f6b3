"""The default mode's split-K decode GEMM (`monorl.ops.decode_gemm.split_k_parts`: two fp32 K parts, summed by the
kernel after it) against the invariant GEMM's decode tiling and cuBLAS, at decode rows, the weights cold (each timed
call reads another copy, ~256 MB in turn, as a decode step's 28 layers do). The parts are checked against an fp32
product and for determinism.

  python benchmarks/tune_decode_gemm.py --out tune_decode_gemm.json
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench_cudagraph

from monorl.ops import decode_gemm
from monorl.ops import matmul_invariant as mi

SHAPES = {"0.6b o": (1024, 2048), "0.6b down": (1024, 3072), "0.6b qkv fused": (4096, 1024),
          "1.7b o": (2048, 2048), "1.7b down": (2048, 6144)}
COLD_BYTES = 256 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="40,64")
    ap.add_argument("--out", default="tune_decode_gemm.json")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {}
    print(f"device {torch.cuda.get_device_name()}; us per product, weights cold")
    print("| shape | rows | cuBLAS | invariant decode tiling | split-K parts |")
    print("|---|---|---|---|---|")
    for name, (N, K) in SHAPES.items():
        ws = [(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
              for _ in range(max(1, COLD_BYTES // (N * K * 2)))]
        for M in map(int, a.rows.split(",")):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            ref = x.float() @ ws[0].float().t()

            def timed(product, x=x, ws=ws):
                return do_bench_cudagraph(lambda: [product(x, w) for w in ws], rep=20) / len(ws) * 1e3

            row = {"cublas": timed(lambda x, w: x @ w.t()), "invariant": timed(lambda x, w: mi._mm_triton(x, w))}
            parts = decode_gemm.split_k_parts(x, ws[0])
            torch.testing.assert_close(parts.sum(0), ref, atol=2e-2, rtol=2e-2)
            assert torch.equal(decode_gemm.split_k_parts(x, ws[0]), parts), f"{name} {M}: not deterministic"
            row["split_k_parts"] = timed(decode_gemm.split_k_parts)
            res[f"{name} {M}"] = row
            print(f"| {name} | {M} | " + " | ".join(f"{v:.2f}" for v in row.values()) + " |", flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
