"""The default mode's decode-step GEMM for narrow products: x [M <= 192, K] @ w [N, K]^T with K split in parts.

Why: at decode rows every program of `matmul_invariant`'s decode tiling reads all of x's K columns (from L2) beside
its own weight rows, ~2K x (rows + tile columns) bytes, and a program moves them at ~30 KB/us whatever its shape
(H200): a product of N = 1024 columns (Qwen3-0.6B's o and down projections) runs 64 programs of 16 columns, half
the SMs idle. Two K parts give twice the programs, each moving half that (Qwen3-1.7B's 2048-column o and down: 64
programs of 32 columns, `block_n`). Measured at 40 rows (`benchmarks/tune_decode_gemm.py`, H200, weights cold): 0.6B
o 5.38 -> 4.21 us, down 7.14 -> 5.27; 1.7B o 5.64 -> 4.71, down 12.64 -> 9.49. Not the q/k/v product (4096 columns,
128 programs already): 4.67 -> 4.59 us in 64-column parts, and the q/k pass summing them got slower by as much.

From 65 to `decode_gemm.mid_rows_max` rows (192; the launch values are in ops/tunables.py; the throughput run's steps)
the same kernel runs 64-row tiles of `mid_block_n` columns in place of cuBLAS, whose launches there take a few
microseconds over their bytes (Qwen3-0.6B's four layer products 26.6 us at 128 rows against ~6.7 us of weight at 4.67
TB/s), with as many K parts (up to `max_mid_parts`, at least 2) as fill the SMs once (`parts_for`). Measured alone
(`benchmarks/tune_mid_rows_gemm.py`, H200, weights cold, cuBLAS -> 4 parts): o 6.12 -> 4.54 us at 128 rows, down 8.46 ->
5.36. In the graphed decode step (`profile_decode_step.py --variants`, Qwen3-0.6B, ms, cuBLAS / 4 parts / 2 parts): 96
rows 2.98 / 2.85 / 2.91, 128 rows 3.47 / 3.35 (4), 192 rows 4.25-4.30 / 4.41-4.43 / 4.23, 256 rows 5.05-5.13 / 5.11-5.15
/ 5.13-5.26; hence 4 parts to 128 rows, 2 to 192, cuBLAS above. The wide products (q/k/v, gate/up) stay on cuBLAS,
faster there alone (5.57 against 6.04 us, 6.43 against 7.69 at 128 rows).

The parts' fp32 sums are not added here: a reduction inside the launch (the last program of a column tile adding
them, behind an acquire-release counter) cost ~2 us of a 5-7 us launch (`benchmarks/tune_decode_gemm.py`, H200), so
`split_k_parts` returns both and the kernel that reads the product next adds them as it loads it (the residual add
+ norm, `block_kernels.add_parts_rms_norm`, also the final norm's: `fused_kernels.project`).
The sum is ((p0 + p1) + p2) + ... rounded to the model's dtype: deterministic, but not the invariant GEMM's single
K loop, so the batch-invariant mode never calls this (its generator's products must be the trainer's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, custom_op, pdl_launch, sm_count, use_triton
from monorl.ops.tunables import HOPPER, chip_for, chip_of, tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit(do_not_specialize=["M"])
    def _split_k_kernel(a_ptr, b_ptr, p_ptr, M, N, K, KS, stride_am, stride_bn, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr = False,
                        PDL: tl.constexpr = False):
        """Program (column tile n, part s, row tile m): rows m * BLOCK_M .. over K columns s * KS .. (s + 1) * KS - 1,
        its fp32 sums to p_ptr [parts, M, N]. IEEE: fp32 operands multiplied in full fp32, as the invariant GEMM's
        (`matmul_invariant_split.partials`: its parts must be that kernel's; the default mode's may run TF32)."""
        if PDL:
            pdl_start()
        pid_n = tl.program_id(0)
        s = tl.program_id(1)
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(s * KS, tl.minimum(K, s * KS + KS), BLOCK_K):
            kk = k0 + offs_k
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :],
                        mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + kk[None, :],
                        mask=(offs_n[:, None] < N) & (kk[None, :] < K), other=0.0)
            if IEEE:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        tl.store(p_ptr + s * M * N + offs_m[:, None] * N + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


    @triton.jit
    def _sum_parts_kernel(p_ptr, o_ptr, n, PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """o = ((p0 + p1) + p2) + ... over PARTS fp32 parts of n elements each, rounded to o's dtype."""
        if PDL:
            pdl_start()
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
        for i in tl.static_range(1, PARTS):
            acc += tl.load(p_ptr + i * n + offs, mask=mask, other=0.0)
        tl.store(o_ptr + offs, acc.to(o_ptr.dtype.element_ty), mask=mask)


def parts_for(rows: int, n: int, sms: int, *, chip: str = HOPPER) -> int:
    """How many K parts `split_k_parts` writes for `rows` x `n` outputs on `sms` SMs: `decode_gemm.parts` up to
    `max_rows`; above, as many as make the (row tile, column tile, part) programs fill the SMs once, at most
    `max_mid_parts` (1: none)."""
    if rows <= tuned("decode_gemm.max_rows", chip):
        return tuned("decode_gemm.parts", chip)
    tiles = -(-rows // tuned("decode_gemm.block_m", chip)) * -(-n // tuned("decode_gemm.mid_block_n", chip))
    return max(1, min(tuned("decode_gemm.max_mid_parts", chip), sms // tiles))


def block_n(N: int, sms: int, *, chip: str = HOPPER) -> int:
    """The narrowest column tile, 16 to `decode_gemm.max_block_n`, whose `parts` x tiles programs run in one wave on
    `sms` SMs (a program's bytes are ~2K x (rows + tile) / parts: narrow tiles, as long as the programs fit); 0 if
    none does."""
    parts, widest = tuned("decode_gemm.parts", chip), tuned("decode_gemm.max_block_n", chip)
    bn = 16
    while parts * -(-N // bn) > sms and bn < widest:
        bn *= 2
    return bn if parts * -(-N // bn) <= sms else 0


def split_k_fits(x: Tensor, w: Tensor) -> bool:
    """Whether `split_k_parts` runs x [M, K] @ w [N, K]^T: CUDA, K of at least `decode_gemm.min_k_blocks` K blocks,
    and either at most `max_rows` rows with a column tile within `max_block_n` (`block_n`), or at most
    `mid_rows_max` rows where two or more parts fill the SMs (`parts_for`: Qwen3-0.6B's o and down; 1.7B's to 128
    rows). Measured on Hopper only (`decode_gemm.enabled`)."""
    if not use_triton(x) or x.dim() != 2:
        return False
    index = x.device.index or 0
    chip = chip_of(index)
    if not tuned("decode_gemm.enabled", chip) or \
            x.shape[1] < tuned("decode_gemm.min_k_blocks", chip) * tuned("decode_gemm.block_k", chip):
        return False
    sms = sm_count(index)
    if x.shape[0] <= tuned("decode_gemm.max_rows", chip):
        return block_n(w.shape[0], sms, chip=chip) > 0
    return x.shape[0] <= tuned("decode_gemm.mid_rows_max", chip) and parts_for(x.shape[0], w.shape[0], sms,
                                                                               chip=chip) > 1


@custom_op("monorl::split_k_parts", mutates_args=())
def split_k_parts(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K]^T as its K parts' fp32 sums [`parts_for`, M, N] (CUDA; see the module docstring)."""
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    index = x.device.index or 0
    sms, chip = sm_count(index), chip_of(index)
    P = parts_for(M, N, sms, chip=chip)
    parts = torch.empty(P, M, N, dtype=torch.float32, device=x.device)
    if M:
        bm, bk = tuned("decode_gemm.block_m", chip), tuned("decode_gemm.block_k", chip)
        ks = triton.cdiv(triton.cdiv(K, P), bk) * bk
        if M <= tuned("decode_gemm.max_rows", chip):  # one row tile: a deep pipeline, one program an SM
            bn = block_n(N, sms, chip=chip) or tuned("decode_gemm.max_block_n", chip)
            stages = tuned("decode_gemm.stages_one_tile", chip)
        else:
            bn, stages = tuned("decode_gemm.mid_block_n", chip), tuned("decode_gemm.stages_mid", chip)
        _split_k_kernel[(triton.cdiv(N, bn), P, triton.cdiv(M, bm))](
            x, w, parts, M, N, K, ks, x.stride(0), w.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=tuned("decode_gemm.warps", chip), num_stages=stages, **pdl_launch(x))
    return parts


@split_k_parts.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    index = x.device.index or 0
    P = parts_for(x.shape[0], w.shape[0], sm_count(index), chip=chip_of(index))
    return x.new_empty(P, x.shape[0], w.shape[0], dtype=torch.float32)


def sum_parts(parts: Tensor, dtype: torch.dtype) -> Tensor:
    """The product `split_k_parts` (or `matmul_invariant_split.partials`) split: ((p0 + p1) + p2) + ... in fp32,
    rounded to dtype (what the kernels that take parts do); on CUDA one launch (`_sum_parts_kernel`)."""
    if use_triton(parts):
        return _sum_parts_triton(parts, dtype)
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.to(dtype)


def _sum_parts_triton(parts: Tensor, dtype: torch.dtype) -> Tensor:
    parts = parts.contiguous()
    out = torch.empty(parts.shape[1:], dtype=dtype, device=parts.device)
    n = out.numel()
    if n:
        block = tuned("decode_gemm.sum_block", chip_for(parts))
        _sum_parts_kernel[(triton.cdiv(n, block),)](parts, out, n, PARTS=parts.shape[0], BLOCK=block,
                                                    num_warps=tuned("decode_gemm.sum_warps", chip_for(parts)),
                                                    **pdl_launch(parts))
    return out
