"""The default mode's decode-step GEMM for narrow products: x [M <= 64, K] @ w [N, K]^T with K split in two.

Why: at decode rows every program of `matmul_invariant`'s decode tiling reads all of x's K columns (from L2) beside
its own 16 weight rows, so a product of N = 1024 columns (Qwen3-0.6B's o and down projections) runs 64 programs
that each move ~2K x (40 + 16) bytes: half the SMs idle, the others busy for the whole launch. Two K parts give
twice the programs, each moving half that. The parts' fp32 sums are not added here: a reduction inside the launch
(the last program of a column tile adding them, behind an acquire-release counter) cost ~2 us of its ~5-7 us
(`benchmarks/tune_decode_gemm.py`, H200), so `split_k_parts` returns both and the kernel that reads the product
next adds them (`block_kernels.add_rms_norm` takes them in place of its addend). The sum is p0 + p1 rounded to the
output dtype: deterministic, but not the invariant GEMM's single K loop, so the batch-invariant mode never calls this
(its generator's products must be the trainer's).
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
BLOCK_N = 16
BLOCK_K = 128
MAX_ROWS = 64  # one 64-row tile


def split_k_fits(x: Tensor, w: Tensor) -> bool:
    """Whether `split_k_parts` pays for x [M, K] @ w [N, K]^T: CUDA, at most MAX_ROWS rows, a product whose
    16-column tiles fill at most half the SMs (twice the programs then still run in one wave), K of at least four K
    blocks. Measured on Hopper only: callers also ask `matmul_invariant.faster_than_cublas`."""
    if not use_triton(x) or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[1] < 4 * BLOCK_K:
        return False
    return PARTS * -(-w.shape[0] // BLOCK_N) <= sm_count(x.device.index or 0)


@custom_op("monorl::split_k_parts", mutates_args=())
def split_k_parts(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K]^T as its two K halves' fp32 sums [2, M, N] (CUDA; see the module docstring)."""
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    parts = torch.empty(PARTS, M, N, dtype=torch.float32, device=x.device)
    if M:
        ks = triton.cdiv(triton.cdiv(K, PARTS), BLOCK_K) * BLOCK_K
        _split_k_kernel[(triton.cdiv(N, BLOCK_N), PARTS)](
            x, w, parts, M, N, K, ks, x.stride(0), w.stride(0), BLOCK_M=64, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            num_warps=4, num_stages=6, **pdl_launch(x))
    return parts


@split_k_parts.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(PARTS, x.shape[0], w.shape[0], dtype=torch.float32)


def sum_parts(parts: Tensor, dtype: torch.dtype) -> Tensor:
    """The product `split_k_parts` split: p0 + p1 in fp32, rounded to dtype (what the kernels that take parts do)."""
    return (parts[0] + parts[1]).to(dtype)
