"""Pipeline depth and warps of the paged-decode attention (`monorl.ops.attention_triton._attn_kernel`, PAGED) at
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
import json

import torch
import triton
from triton.testing import do_bench_cudagraph

from monorl.ops import attention_triton as at


def launch(q, kc, vc, lens, bt, out, stages: int | None, warps: int) -> None:
    R, Hq, D = q.shape
    G, rows, _ = at._tile(Hq, kc.shape[-2])
    kw = {} if stages is None else {"num_stages": stages}
    at._attn_kernel[(R, kc.shape[-2])](
        q, kc, vc, out, lens, lens, bt, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        bt.stride(0), out.stride(0), out.stride(1), D ** -0.5, 1, PAGED=True, G=G, ROWS=rows, TOKENS=1, D=D,
        BS=kc.shape[1], BLOCK_N=at.ATTN_BLOCK_N, num_warps=warps, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--contexts", default="150,250,600")
    ap.add_argument("--out", default="tune_decode_attention.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    B, Hq, Hkv, D, BS = a.batch, 16, 8, 128, 16
    res = {}
    print("| context | stages | warps | us per launch | bitwise the default |\n|---|---|---|---|---|")
    for ctx in map(int, a.contexts.split(",")):
        width = triton.cdiv(ctx, BS)
        kc = torch.randn(B * width + 1, BS, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(B * width, device="cuda").view(B, width).int() + 1
        lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32) - torch.arange(B, device="cuda").int() % 7
        q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(q)
        launch(q, kc, vc, lens, bt, ref, None, 4)  # as varlen launches it
        for stages in (None, 1, 2, 3, 4, 5):
            for warps in (4, 2, 8):
                out = torch.empty_like(q)
                try:
                    launch(q, kc, vc, lens, bt, out, stages, warps)
                    args = (q, kc, vc, lens, bt, out, stages, warps)
                    ms = do_bench_cudagraph(lambda args=args: launch(*args), rep=20)
                except Exception as e:  # e.g. out of shared memory
                    print(f"| {ctx} | {stages} | {warps} | {type(e).__name__} | |")
                    continue
                same = torch.equal(out, ref)
                res[f"{ctx},{stages},{warps}"] = {"us": ms * 1e3, "bitwise": same}
                print(f"| {ctx} | {stages or 'default'} | {warps} | {ms * 1e3:.2f} | {same} |", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
