"""K parts for the batch-invariant GEMM's decode step (issue #62; `monorl.ops.matmul_invariant_split`): for each of
Qwen3-0.6B's decode-step products in the generator's fused layout, at 40 rows, bf16, every part count P in 1, 2, 4, 8
timed in both kernels that compute it, beside the weight's bytes floor (its bytes / 3.35e12 B/s, an H100 SXM's HBM):

- tile walk: `_mm_kernel` (or the gate/up product's `_mm_silu_kernel`), a program per output tile walking the parts;
- partials + sum: a program per (tile, part), then `decode_gemm.sum_parts` (one launch) -- q/k/v and the LM head;
- partials: the same without the sum -- o and down, whose parts the next residual add + norm sums as it loads them
  (that kernel's extra fp32 reads are not in this number);
- bi_mm's pick: what the table would run with P set for this K (`partials_pay`).

P is keyed by K alone (`matmul_split.parts`, so fused and unfused weights agree): K = 1024 is q/k/v, gate/up and the
LM head together, 2048 is o, 3072 is down; the summary sums each K's products at each P (the gate/up product always
walks its parts). Each (a) / (b) pair is also checked bitwise equal. Timed as CUDA-graph replays of `--calls` products
(a decode step's products come from a graph), CUDA events, the median of `--reps`; each call reads another copy of
the weight (~256 MB of copies, as a decode step's 28 layers do) unless `--warm`.

  python benchmarks/tune_invariant_split.py --out tune_invariant_split.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from monorl.ops import decode_gemm, matmul_invariant, matmul_invariant_split
from monorl.ops.tunables import overridden

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up+silu": (6144, 1024), "down": (1024, 3072),
          "lm head": (151936, 1024)}  # name: (N, K), the generator's fused layout
HBM_BYTES_PER_S = 3.35e12
COLD_BYTES = 256 << 20


def time_us(product, ws: list[torch.Tensor], calls: int, reps: int) -> float:
    """us per product: the median over reps of a CUDA graph replaying `calls` products (weights in turn)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in ws[:2]:
            product(w)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            product(ws[i % len(ws)])
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def measure(name: str, N: int, K: int, P: int, x: torch.Tensor, ws: list[torch.Tensor], calls: int,
            reps: int) -> dict:
    """One row of the table: the product `name` in P parts, both kernels, bi_mm's pick, and whether they agree."""
    def timed(product):
        return time_us(product, ws, calls, reps)

    if name.startswith("gate_up"):  # the SiLU epilogue's kernel: it walks the parts in every program
        out = torch.empty(x.shape[0], N // 2, dtype=x.dtype, device="cuda")
        walk = timed(lambda w: matmul_invariant._mm_silu_triton(x, w, out, parts=P))
        return {"tile_walk": walk, "pick": walk, "bitwise": None}
    row = {"tile_walk": timed(lambda w: matmul_invariant._mm_triton(x, w, parts=P))}
    if P > 1:
        row["partials_sum"] = timed(lambda w: decode_gemm.sum_parts(matmul_invariant_split.partials(x, w, parts=P),
                                                                    x.dtype))
        row["partials"] = timed(lambda w: matmul_invariant_split.partials(x, w, parts=P))
    with overridden({"matmul_split.parts": ((K, P),)}), torch.no_grad():
        row["pick"] = timed(lambda w: matmul_invariant.bi_mm(x, w))
        if name in ("o", "down") and matmul_invariant_split.partials_fit(x, ws[0]):
            row["pick"] = row["partials"]  # the block hands these parts to the next add + norm
    walk = matmul_invariant._mm_triton(x, ws[0], parts=P)
    parts = matmul_invariant_split.partials(x, ws[0], parts=P)
    row["bitwise"] = bool(torch.equal(walk, decode_gemm.sum_parts(parts, x.dtype)))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--parts", default="1,2,4,8")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warm", action="store_true", help="one weight copy (it stays in L2)")
    ap.add_argument("--out", default="tune_invariant_split.json")
    a = ap.parse_args()
    M, counts = a.rows, [int(p) for p in a.parts.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}; {M} rows, bf16, us per product, weights "
          f"{'warm' if a.warm else 'cold'}")
    print("| product | (N, K) | P | floor | tile walk | partials + sum | partials | bi_mm's pick | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|")
    res: dict = {}
    for name, (N, K) in SHAPES.items():
        nbytes = N * K * 2
        copies = 1 if a.warm else max(2, COLD_BYTES // nbytes)
        ws = [(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16() for _ in range(copies)]
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        floor = nbytes / HBM_BYTES_PER_S * 1e6
        for P in counts:
            row = measure(name, N, K, P, x, ws, a.calls, a.reps)
            row["floor_us"] = floor
            res[f"{name} P={P}"] = row
            cells = [f"{row[k]:.2f}" if isinstance(row.get(k), float) else "-"
                     for k in ("floor_us", "tile_walk", "partials_sum", "partials", "pick")]
            print(f"| {name} | ({N}, {K}) | {P} | " + " | ".join(cells) + f" | {row['bitwise']} |", flush=True)
        del ws
        torch.cuda.empty_cache()
    print("\nper K, bi_mm's picks summed over its products (choose matmul_split.parts per K from the smallest):")
    print("| K | products | " + " | ".join(f"P={p}" for p in counts) + " |")
    print("|---|---|" + "---|" * len(counts))
    for K in sorted({k for _, k in SHAPES.values()}):
        names = [n for n, (_, k) in SHAPES.items() if k == K]
        sums = [sum(res[f"{n} P={p}"]["pick"] for n in names) for p in counts]
        print(f"| {K} | {', '.join(names)} | " + " | ".join(f"{s:.2f}" for s in sums) + " |")
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": M, "warm": a.warm, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
