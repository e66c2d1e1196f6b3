"""What the GPU reads at most, and what the paged decode attention leaves of it (issue 18's throughput floor).

Three kernels over the same bytes, timed in CUDA graphs (`triton.testing.do_bench_cudagraph`), each printed as TB/s:

  stream:  a contiguous bf16 buffer (4 GiB, far past L2) summed by P programs an SM, each walking its own
           contiguous run in loads of BLOCK elements: the device's read bandwidth with the most bytes in flight.
  paged:   the paged decode's addressing without its arithmetic: program (row, kv head) walks its keys in 64-key
           blocks through the block table (16-token cache blocks [N, 16, Hkv, D], 256 contiguous bytes a key and
           head), the block ids loaded a block ahead, and sums the key and value tiles.
  attn:    `monorl.ops.attention.kernel.attention_triton` on the same caches (one split, the throughput run's).
  rows:    program (row, split) reads its share of the row's cache blocks for every kv head at once (a block's
           keys are one contiguous 16 x 8 x 128 run, 32 KiB), splits 1-8, 4 or 8 warps: another layout of the
           same reads.

Rows and contexts are those of the throughput run's decode steps (`bench_throughput.py`): 256 rows of ~700 keys,
138 of ~1000, 70 of ~1250, 34 of ~1460, contexts uniform in [ctx / 4, 7 ctx / 4].

  python benchmarks/probe_read_bandwidth.py --out probe_read_bandwidth.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from monorl.ops.attention import kernel as at
from monorl.ops.tunables import chip_of, tuned


@triton.jit
def _stream_kernel(x_ptr, out_ptr, n_per, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * n_per
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n_per, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _paged_kernel(k_ptr, v_ptr, lens_ptr, bt_ptr, out_ptr, stride_kblk, stride_ktok, stride_kh, stride_btb,
                  D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    n = tl.load(lens_ptr + pid)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    table = bt_ptr + pid * stride_btb
    blk_next = tl.load(table + offs_n // BS, mask=offs_n < n, other=0)
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for start_n in range(0, n, BLOCK_N):
        key = start_n + offs_n
        nmask = key < n
        blk = blk_next
        blk_next = tl.load(table + (key + BLOCK_N) // BS, mask=key + BLOCK_N < n, other=0)
        off = blk.to(tl.int64) * stride_kblk + (key % BS) * stride_ktok + hk * stride_kh
        k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + pid * tl.num_programs(1) + hk, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _rows_kernel(k_ptr, v_ptr, lens_ptr, bt_ptr, out_ptr, stride_kblk, stride_btb, SPLITS: tl.constexpr,
                 HD: tl.constexpr, BS: tl.constexpr):
    """Program (row, split): its share of the row's keys, every kv head: a cache block's K (and V) is one
    contiguous BS x HD run."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.load(lens_ptr + pid)
    nb = tl.cdiv(n, BS)
    per = tl.cdiv(nb, SPLITS)
    offs = tl.arange(0, BS)[:, None] * HD + tl.arange(0, HD)[None, :]
    acc = tl.zeros([BS, HD], dtype=tl.float32)
    table = bt_ptr + pid * stride_btb
    for b in range(s * per, tl.minimum(nb, s * per + per)):
        blk = tl.load(table + b).to(tl.int64)
        acc += tl.load(k_ptr + blk * stride_kblk + offs).to(tl.float32)
        acc += tl.load(v_ptr + blk * stride_kblk + offs).to(tl.float32)
    tl.store(out_ptr + pid * SPLITS + s, tl.sum(tl.sum(acc, 1), 0))


def stream_rows(sms: int) -> list[dict]:
    x = torch.randn(1 << 31, device="cuda", dtype=torch.bfloat16)  # 4 GiB
    rows = []
    for per_sm in (1, 2, 4, 8, 16):
        for block in (2048, 8192):
            for warps in (4, 8):
                programs = per_sm * sms
                n_per = (x.numel() // programs) // block * block
                out = torch.empty(programs, device="cuda", dtype=torch.float32)

                def fn(programs=programs, n_per=n_per, out=out, block=block, warps=warps):
                    _stream_kernel[(programs,)](x, out, n_per, BLOCK=block, num_warps=warps)

                ms = do_bench_cudagraph(fn, rep=50)
                tb_s = programs * n_per * 2 / ms / 1e9
                rows.append({"kernel": "stream", "programs_per_sm": per_sm, "block": block, "warps": warps,
                             "us": ms * 1e3, "tb_s": tb_s})
                print(f"| stream | {per_sm} programs an SM, {block}-element loads, {warps} warps | {ms * 1e3:,.0f} | "
                      f"{tb_s:.2f} |", flush=True)
    return rows


def paged_rows(batch: int, ctx: int, copies: int) -> list[dict]:
    torch.manual_seed(0)
    Hq, Hkv, D, BS = 16, 8, 128, 16
    width = triton.cdiv(ctx * 7 // 4, BS)
    caches = [(torch.randn(batch * width + 1, BS, Hkv, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(batch * width + 1, BS, Hkv, D, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    bt = torch.randperm(batch * width, device="cuda").view(batch, width).int() + 1
    lens = torch.randint(ctx // 4, ctx * 7 // 4 + 1, (batch,), device="cuda", dtype=torch.int32)
    q = torch.randn(batch, Hq, D, device="cuda", dtype=torch.bfloat16)
    kv_bytes = int(lens.sum()) * Hkv * D * 2 * 2
    out = torch.empty(batch, Hkv, device="cuda", dtype=torch.float32)
    kc = caches[0][0]

    def paged():
        for k, v in caches:
            _paged_kernel[(batch, Hkv)](k, v, lens, bt, out, kc.stride(0), kc.stride(1), kc.stride(2), bt.stride(0),
                                        D=D, BS=BS, BLOCK_N=tuned("attention.block_n", chip_of(0)),
                                        num_warps=tuned("attention.warps", chip_of(0)))

    def attn():
        for k, v in caches:
            at.attention_triton(q, k, v, lens, bt)

    def rows_kernel(splits, warps):
        o = torch.empty(batch * splits, device="cuda", dtype=torch.float32)

        def fn():
            for k, v in caches:
                _rows_kernel[(batch, splits)](k, v, lens, bt, o, kc.stride(0), bt.stride(0), SPLITS=splits,
                                              HD=Hkv * D, BS=BS, num_warps=warps)
        return fn

    variants = [("paged", paged), ("attn", attn)]
    variants += [(f"rows, {s} splits, {w} warps", rows_kernel(s, w)) for s in (1, 2, 4, 8) for w in (4, 8)]
    rows = []
    for name, fn in variants:
        ms = do_bench_cudagraph(fn, rep=50) / copies
        tb_s = kv_bytes / ms / 1e9
        rows.append({"kernel": name, "batch": batch, "ctx": ctx, "us": ms * 1e3, "tb_s": tb_s})
        print(f"| {name} | {batch} rows of ~{ctx} keys | {ms * 1e3:,.1f} | {tb_s:.2f} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256/700,138/1000,70/1250,34/1460", help="rows/context pairs")
    ap.add_argument("--copies", type=int, default=4, help="KV caches launched in turn (each read cold, as layers)")
    ap.add_argument("--no-stream", action="store_true", help="skip the contiguous-read rows")
    ap.add_argument("--out", default="probe_read_bandwidth.json")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs\n| kernel | shape | us | TB/s |\n|---|---|---|---|")
    rows = [] if a.no_stream else stream_rows(sms)
    for spec in a.shapes.split(","):
        batch, ctx = map(int, spec.split("/"))
        rows += paged_rows(batch, ctx, a.copies)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
