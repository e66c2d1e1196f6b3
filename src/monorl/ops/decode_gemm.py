"""The default mode's decode-step GEMM for narrow products: x [M <= 192, K] @ w [N, K]^T with K split in parts.

Why: at decode rows every program of `matmul_invariant`'s decode tiling reads all of x's K columns (from L2) beside
its own weight rows, ~2K x (rows + tile columns) bytes, and a program moves them at ~30 KB/us whatever its shape
(H200): a product of N = 1024 columns (Qwen3-0.6B's o and down projections) runs 64 programs of 16 columns, half
the SMs idle. Two K parts give twice the programs, each moving half that (Qwen3-1.7B's 2048-column o and down: 64
programs of 32 columns, `block_n`). Measured at 40 rows (`benchmarks/tune_decode_gemm.py`, H200, weights cold): 0.6B
o 5.38 -> 4.21 us, down 7.14 -> 5.27; 1.7B o 5.64 -> 4.71, down 12.64 -> 9.49. Not the q/k/v product (4096 columns,
128 programs already): 4.67 -> 4.59 us in 64-column parts, and the q/k pass summing them got slower by as much.

From 65 to MID_ROWS_MAX rows (the throughput run's steps) the same kernel runs 64-row tiles of MID_BLOCK_N columns in
place of cuBLAS, whose launches there take a few microseconds over their bytes (Qwen3-0.6B's four layer products 26.6
us at 128 rows against ~6.7 us of weight at 4.67 TB/s), with as many K parts (up to MAX_MID_PARTS, at least 2) as
fill the SMs once (`parts_for`). Measured alone (`benchmarks/tune_mid_rows_gemm.py`, H200, weights cold, cuBLAS -> 4
parts): o 6.12 -> 4.54 us at 128 rows, down 8.46 -> 5.36. In the graphed decode step (`profile_decode_step.py
--variants`, Qwen3-0.6B, ms, cuBLAS / 4 parts / 2 parts): 96 rows 2.98 / 2.85 / 2.91, 128 rows 3.47 / 3.35 (4), 192
rows 4.25-4.30 / 4.41-4.43 / 4.23, 256 rows 5.05-5.13 / 5.11-5.15 / 5.13-5.26; hence 4 parts to 128 rows, 2 to 192,
cuBLAS above. The wide products (q/k/v, gate/up) stay on cuBLAS, faster there alone (5.57 against 6.04 us, 6.43
against 7.69 at 128 rows).

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
from monorl.ops.matmul_invariant import tiling_may_follow_m

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit(do_not_specialize=["M"])
    def _split_k_kernel(a_ptr, b_ptr, p_ptr, M, N, K, KS, stride_am, stride_bn, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """Program (column tile n, part s, row tile m): rows m * BLOCK_M .. over K columns s * KS .. (s + 1) * KS - 1,
        its fp32 sums to p_ptr [parts, M, N]."""
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
            acc = tl.dot(a, tl.trans(b), acc)
        tl.store(p_ptr + s * M * N + offs_m[:, None] * N + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


PARTS = 2  # K parts up to 64 rows (one row tile)
BLOCK_K = 128
MAX_BLOCK_N = 64
MAX_ROWS = 64  # one 64-row tile
MID_ROWS_MAX = 192  # 65..MID_ROWS_MAX rows: 64-row tiles of MID_BLOCK_N columns (0: cuBLAS there)
MID_BLOCK_N = 64
MAX_MID_PARTS = 4


def parts_for(rows: int, n: int, sms: int) -> int:
    """How many K parts `split_k_parts` writes for `rows` x `n` outputs on `sms` SMs: PARTS up to MAX_ROWS; above,
    as many as make the (row tile, column tile, part) programs fill the SMs once, at most MAX_MID_PARTS (1: none)."""
    if rows <= MAX_ROWS:
        return PARTS
    return max(1, min(MAX_MID_PARTS, sms // (-(-rows // 64) * -(-n // MID_BLOCK_N))))


def block_n(N: int, sms: int) -> int:
    """The narrowest column tile, 16 to MAX_BLOCK_N, whose PARTS x tiles programs run in one wave on `sms` SMs (a
    program's bytes are ~2K x (rows + tile) / PARTS: narrow tiles, as long as the programs fit); 0 if none does."""
    bn = 16
    while PARTS * -(-N // bn) > sms and bn < MAX_BLOCK_N:
        bn *= 2
    return bn if PARTS * -(-N // bn) <= sms else 0


def split_k_fits(x: Tensor, w: Tensor) -> bool:
    """Whether `split_k_parts` runs x [M, K] @ w [N, K]^T: CUDA, K of at least four K blocks, and either at most
    MAX_ROWS rows with a column tile within MAX_BLOCK_N (`block_n`), or at most MID_ROWS_MAX rows where two or more
    parts fill the SMs (`parts_for`: Qwen3-0.6B's o and down; 1.7B's to 128 rows). Measured on Hopper only
    (`matmul_invariant.tiling_may_follow_m`)."""
    if not use_triton(x) or x.dim() != 2 or x.shape[1] < 4 * BLOCK_K or not tiling_may_follow_m(x.device.index or 0):
        return False
    sms = sm_count(x.device.index or 0)
    if x.shape[0] <= MAX_ROWS:
        return block_n(w.shape[0], sms) > 0
    return x.shape[0] <= MID_ROWS_MAX and parts_for(x.shape[0], w.shape[0], sms) > 1


@custom_op("monorl::split_k_parts", mutates_args=())
def split_k_parts(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K]^T as its K parts' fp32 sums [`parts_for`, M, N] (CUDA; see the module docstring)."""
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    sms = sm_count(x.device.index or 0)
    P = parts_for(M, N, sms)
    parts = torch.empty(P, M, N, dtype=torch.float32, device=x.device)
    if M:
        ks = triton.cdiv(triton.cdiv(K, P), BLOCK_K) * BLOCK_K
        if M <= MAX_ROWS:  # one row tile: a deep pipeline, one program an SM
            bn, stages = block_n(N, sms) or MAX_BLOCK_N, 6
        else:
            bn, stages = MID_BLOCK_N, 4
        _split_k_kernel[(triton.cdiv(N, bn), P, triton.cdiv(M, 64))](
            x, w, parts, M, N, K, ks, x.stride(0), w.stride(0), BLOCK_M=64, BLOCK_N=bn, BLOCK_K=BLOCK_K,
            num_warps=4, num_stages=stages, **pdl_launch(x))
    return parts


@split_k_parts.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    P = parts_for(x.shape[0], w.shape[0], sm_count(x.device.index or 0))
    return x.new_empty(P, x.shape[0], w.shape[0], dtype=torch.float32)


def sum_parts(parts: Tensor, dtype: torch.dtype) -> Tensor:
    """The product `split_k_parts` split: ((p0 + p1) + p2) + ... in fp32, rounded to dtype (what the kernels that
    take parts do)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc.to(dtype)
