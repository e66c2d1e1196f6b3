"""Key splits of the paged decode at a Gemma 3 decode step's two layer kinds (#57's bytes floor): 64 rows, 4 query
heads on 1 kv head of 256, 16-token blocks, ~16k keys a row. A window layer reads the last 512 keys through its ring
(33 blocks a row, the table mapped onto them as `RecycledWindowKV` maps it); a full layer reads all of them. Each
launch set runs on `--copies` caches in turn (cold, as a step's layers), timed in CUDA graphs; TB/s counts the keys
and values the kernel must read (a window row: its last 512 keys and the rest of their first 64-key block).

  python benchmarks/tune_window_splits.py --out tune_window_splits.json
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench_cudagraph

from monorl.ops.attention import kernel as at


def case(window: int, rows: int, context: int, splits: int, copies: int) -> dict:
    Hq, Hkv, D, BS = 4, 1, 256, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.randint(context, context + 64, (rows,), device="cuda", generator=g, dtype=torch.int32)
    width = -(-int(lens.max()) // BS)
    if window:
        ring = -(-window // BS) + 1
        blocks = 1 + rows * ring
        bt = 1 + torch.arange(rows, device="cuda")[:, None] * ring + torch.arange(width, device="cuda")[None] % ring
        keys = (lens - (lens - window).div(64, rounding_mode="floor") * 64).sum()
    else:
        blocks = 1 + rows * width
        bt = 1 + torch.randperm(rows * width, device="cuda", generator=g).view(rows, width)
        keys = lens.sum()
    bt = bt.to(torch.int32).contiguous()
    caches = [(torch.randn(blocks, BS, Hkv, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(blocks, BS, Hkv, D, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    q = torch.randn(rows, Hq, D, device="cuda", dtype=torch.bfloat16)

    def fn() -> None:
        for kc, vc in caches:
            at.attention_triton(q, kc, vc, lens, bt, splits, window=window)

    us = do_bench_cudagraph(fn, rep=50) / copies * 1e3
    nbytes = int(keys) * Hkv * D * 2 * 2
    return {"window": window, "rows": rows, "context": context, "splits": splits, "us": us,
            "tb_s": nbytes / us / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--window-splits", default="1,2,4,8,16")
    ap.add_argument("--full-splits", default="8,16,32")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--out", default="tune_window_splits.json")
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name(0)}: rows {a.rows}, context ~{a.context}, the kept splits "
          f"{at.decode_splits(a.rows, 1, torch.cuda.get_device_properties(0).multi_processor_count)}\n"
          "| layer | splits | us a launch | TB/s |\n|---|---|---|---|")
    rows = []
    for window, splits in [(512, s) for s in map(int, a.window_splits.split(","))] + \
                          [(0, s) for s in map(int, a.full_splits.split(","))]:
        r = case(window, a.rows, a.context, splits, a.copies)
        rows.append(r)
        print(f"| {'window 512' if window else 'full'} | {splits} | {r['us']:.1f} | {r['tb_s']:.2f} |", flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
