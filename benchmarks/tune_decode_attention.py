"""Pipeline depth and warps of the paged-decode attention (`monorl.ops.attention.kernel._attn_kernel`, PAGED) at
the reference workload's decode shapes: Qwen3-0.6B heads (16 q, 8 kv, head dim 128), 40 sequences, 16-token KV
blocks, contexts of ~150-600 keys. num_stages only changes how far ahead the key/value loads are issued, not the
arithmetic. Each launch is checked bitwise against one with 4 warps and the default stages (what the varlen path
runs) on these random inputs; that is not enough for the batch-invariant mode: 2 warps passed here on every row
and still broke the generator's log-probs against the trainer's in the GPU tests (2026-11-24), so a change found
here needs `pytest -m gpu tests/test_batch_invariant_gpu.py` too. Timed in CUDA graphs, as the decode step replays
it.

  python benchmarks/tune_decode_attention.py --out tune_decode_attention.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import triton
from triton.testing import do_bench_cudagraph

from monorl.ops.attention import kernel as at
from monorl.ops.tunables import chip_of, tuned

CHIP = chip_of(0)
KEPT_BLOCK_N = tuned("attention.block_n", CHIP)  # keys a block of the kept launch (ops/tunables.py)


def launch(q, kc, vc, lens, bt, out, stages: int | None, warps: int, block_n: int = KEPT_BLOCK_N) -> None:
    R, Hq, D = q.shape
    G, rows, _ = at._tile(Hq, kc.shape[-2], CHIP)
    kw = {} if stages is None else {"num_stages": stages}
    at._attn_kernel[(R, kc.shape[-2])](
        q, kc, vc, out, lens, lens, bt, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        bt.stride(0), out.stride(0), out.stride(1), D ** -0.5, 1, out, out, out, 0, 0, out, PAGED=True, G=G, ROWS=rows,
        TOKENS=1, D=D, BS=kc.shape[1], BLOCK_N=block_n, num_warps=warps, **kw)


def launch_each(caches, q, lens, bt, out, stages: int | None, warps: int, block_n: int) -> None:
    for kc, vc in caches:
        launch(q, kc, vc, lens, bt, out, stages, warps, block_n)


def split_each(caches, q, lens, bt, splits: int, block_n: int = KEPT_BLOCK_N) -> None:
    for kc, vc in caches:
        at.attention_triton(q, kc, vc, lens, bt, splits, block_n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--contexts", default="150,250,600")
    ap.add_argument("--stages", default="default,1,2,3,4,5")
    ap.add_argument("--warps", default="4,2,8")
    ap.add_argument("--block-n", default=str(KEPT_BLOCK_N), help="keys per block (a comma list)")
    ap.add_argument("--copies", type=int, default=1,
                    help="launch on this many KV caches in turn (time per launch): caches that fit L2 read cold, as "
                         "a decode step's 28 layers read theirs")
    ap.add_argument("--splits", default="", help="also time `attention_triton` with these key splits (a comma list; "
                    "the default mode's decode, its merge included), 0 = what `decode_splits` picks; "
                    "S/BLOCK_N for another key block")
    ap.add_argument("--spread", action="store_true", help="contexts uniform in [ctx / 4, 7 ctx / 4], not ~ctx")
    ap.add_argument("--longest-first", action="store_true", help="rows ordered by length, longest first (the "
                    "programs of long rows dispatched before the short ones)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens a KV-cache block (the generator's: 16)")
    ap.add_argument("--head-major", action="store_true", help="caches stored [N, Hkv, BS, D] (a kv head's keys of a "
                    "block contiguous), passed as the [N, BS, Hkv, D] view the kernel takes by strides")
    ap.add_argument("--out", default="tune_decode_attention.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    B, Hq, Hkv, D, BS = a.batch, 16, 8, 128, a.block_size
    res = {}
    stage_list = [None if x == "default" else int(x) for x in a.stages.split(",")]
    print("| batch | context | block_n | stages | warps | us per launch | GB/s (K+V read) | bitwise the default |\n"
          "|---|---|---|---|---|---|---|---|")
    for ctx in map(int, a.contexts.split(",")):
        width = triton.cdiv(ctx * 7 // 4 if a.spread else ctx, BS)
        shape = (B * width + 1, BS, Hkv, D)
        def cache(shape: tuple = shape) -> torch.Tensor:
            if a.head_major:
                N, bs, h, d = shape
                return torch.randn(N, h, bs, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            return torch.randn(shape, device="cuda", dtype=torch.bfloat16)

        caches = [(cache(), cache()) for _ in range(a.copies)]
        kc, vc = caches[0]
        bt = torch.randperm(B * width, device="cuda").view(B, width).int() + 1
        if a.spread:
            lens = torch.randint(ctx // 4, ctx * 7 // 4 + 1, (B,), device="cuda", dtype=torch.int32)
        else:
            lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32) - torch.arange(B, device="cuda").int() % 7
        if a.longest_first:
            lens = lens.sort(descending=True).values
        q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(q)
        launch(q, kc, vc, lens, bt, ref, None, 4)  # as varlen launches it
        kv_bytes = int(lens.sum()) * Hkv * D * 2 * kc.element_size()
        for block_n, stages, warps in itertools.product(map(int, a.block_n.split(",")), stage_list,
                                                        map(int, a.warps.split(","))):
            out = torch.empty_like(q)
            try:
                launch(q, kc, vc, lens, bt, out, stages, warps, block_n)
                same = torch.equal(out, ref)  # before the timed launches overwrite out from the other caches
                fn = functools.partial(launch_each, caches, q, lens, bt, out, stages, warps, block_n)
                ms = do_bench_cudagraph(fn, rep=20) / a.copies
            except Exception as e:  # e.g. out of shared memory
                print(f"| {B} | {ctx} | {block_n} | {stages} | {warps} | {type(e).__name__} | | |")
                continue
            res[f"{B},{ctx},{block_n},{stages},{warps}"] = {"us": ms * 1e3, "gb_s": kv_bytes / ms / 1e6,
                                                           "bitwise": same}
            print(f"| {B} | {ctx} | {block_n} | {stages or 'default'} | {warps} | {ms * 1e3:.2f} | "
                  f"{kv_bytes / ms / 1e6:,.0f} | {same} |", flush=True)
        for spec in filter(None, a.splits.split(",")):
            S, bn = (list(map(int, spec.split("/"))) + [KEPT_BLOCK_N])[:2]
            S = S or at.decode_splits(B, Hkv, torch.cuda.get_device_properties(0).multi_processor_count, chip=CHIP)
            out = at.attention_triton(q, kc, vc, lens, bt, S, bn)
            err = (out.float() - ref.float()).abs().max().item()
            fn = functools.partial(split_each, caches, q, lens, bt, S, bn)
            ms = do_bench_cudagraph(fn, rep=20) / a.copies
            res[f"{B},{ctx},splits{spec}"] = {"us": ms * 1e3, "gb_s": kv_bytes / ms / 1e6, "max_err": err}
            print(f"| {B} | {ctx} | splits {spec} | | | {ms * 1e3:.2f} | {kv_bytes / ms / 1e6:,.0f} | "
                  f"max err {err:.1e} |", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
