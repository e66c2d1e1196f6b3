"""The default mode's decode-step GEMM for narrow products: x [M <= 64, K] @ w [N, K]^T with K split in two.

Why: at decode rows every program of `matmul_invariant`'s decode tiling reads all of x's K columns (from L2) beside
its own weight rows, ~2K x (rows + tile columns) bytes, and a program moves them at ~30 KB/us whatever its shape
(H200): a product of N = 1024 columns (Qwen3-0.6B's o and down projections) runs 64 programs of 16 columns, half
the SMs idle. Two K parts give twice the programs, each moving half that (Qwen3-1.7B's 2048-column o and down: 64
programs of 32 columns, `block_n`). Measured at 40 rows (`benchmarks/tune_decode_gemm.py`, H200, weights cold): 0.6B
o 5.38 -> 4.21 us, down 7.14 -> 5.27; 1.7B o 5.64 -> 4.71, down 12.64 -> 9.49. Not the q/k/v product (4096 columns,
128 programs already): 4.67 -> 4.59 us in 64-column parts, and the q/k pass summing them got slower by as much.

The parts' fp32 sums are not added here: a reduction inside the launch (the last program of a column tile adding
them, behind an acquire-release counter) cost ~2 us of a 5-7 us launch (`benchmarks/tune_decode_gemm.py`, H200), so
`split_k_parts` returns both and the kernel that reads the product next adds them as it loads it (the residual add
+ norm, `block_kernels.add_parts_rms_norm`, also the final norm's: `fused_kernels.project`).
The sum is p0 + p1 rounded to the model's dtype: deterministic, but not the invariant GEMM's single K loop, so the
batch-invariant mode never calls this (its generator's products must be the trainer's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, custom_op, pdl_launch, sm_count, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit(do_not_specialize=["M"])
    def _split_k_kernel(a_ptr, b_ptr, p_ptr, M, N, K, KS, stride_am, stride_bn, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """Program (column tile n, part s): rows 0..M-1 (M <= BLOCK_M) over K columns s * KS .. (s + 1) * KS - 1,
        its fp32 sums to p_ptr [parts, M, N]."""
        if PDL:
            pdl_start()
        pid_n = tl.program_id(0)
        s = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
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


PARTS = 2
BLOCK_K = 128
MAX_BLOCK_N = 64
MAX_ROWS = 64  # one 64-row tile


def block_n(N: int, sms: int) -> int:
    """The narrowest column tile, 16 to MAX_BLOCK_N, whose PARTS x tiles programs run in one wave on `sms` SMs (a
    program's bytes are ~2K x (rows + tile) / PARTS: narrow tiles, as long as the programs fit); 0 if none does."""
    bn = 16
    while PARTS * -(-N // bn) > sms and bn < MAX_BLOCK_N:
        bn *= 2
    return bn if PARTS * -(-N // bn) <= sms else 0


def split_k_fits(x: Tensor, w: Tensor) -> bool:
    """Whether `split_k_parts` runs x [M, K] @ w [N, K]^T: CUDA, at most MAX_ROWS rows, K of at least four K blocks,
    a column tile within MAX_BLOCK_N (`block_n`). Measured on Hopper only: callers also ask
    `matmul_invariant.faster_than_cublas`."""
    if not use_triton(x) or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[1] < 4 * BLOCK_K:
        return False
    return block_n(w.shape[0], sm_count(x.device.index or 0)) > 0


@custom_op("monorl::split_k_parts", mutates_args=())
def split_k_parts(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K]^T as its two K halves' fp32 sums [2, M, N] (CUDA; see the module docstring)."""
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    parts = torch.empty(PARTS, M, N, dtype=torch.float32, device=x.device)
    if M:
        ks = triton.cdiv(triton.cdiv(K, PARTS), BLOCK_K) * BLOCK_K
        bn = block_n(N, sm_count(x.device.index or 0)) or MAX_BLOCK_N
        _split_k_kernel[(triton.cdiv(N, bn), PARTS)](
            x, w, parts, M, N, K, ks, x.stride(0), w.stride(0), BLOCK_M=64, BLOCK_N=bn, BLOCK_K=BLOCK_K,
            num_warps=4, num_stages=6, **pdl_launch(x))
    return parts


@split_k_parts.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(PARTS, x.shape[0], w.shape[0], dtype=torch.float32)


def sum_parts(parts: Tensor, dtype: torch.dtype) -> Tensor:
    """The product `split_k_parts` split: p0 + p1 in fp32, rounded to dtype (what the kernels that take parts do)."""
    return (parts[0] + parts[1]).to(dtype)
