"""Batch-invariant matmul: x [.., K] @ w [N, K]^T, where row i of the result depends only on x[i] and w.

Why the default is not: cuBLAS / MKL pick GEMM tilings and split-K by M, the number of rows. Here,
on CUDA, a Triton GEMM whose K order is one fixed order for every M (tilings that change with M change only how the
output is tiled, see `_mm_config`; K parts, where a product has them, are a function of K alone and are summed in
one order, see `monorl.ops.matmul_invariant_split`); on CPU, fp32 products summed by a fixed pairwise tree over K.
A `torch.library` custom op (opaque to torch.compile); backward is ordinary math: only forward values have to
match the generator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, custom_op, pdl_launch, sm_count, use_triton
from monorl.ops.decode_gemm import sum_parts
from monorl.ops.matmul_invariant_split import k_parts, launch_chip, partials, partials_pay
from monorl.ops.tree_sum import tree_sum
from monorl.ops.tunables import HOPPER, chip_of, threshold_pick, tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit(do_not_specialize=["M"])  # M must not change the compiled kernel (Triton specialises 1, %16)
    def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, KS, stride_am, stride_bn, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTS: tl.constexpr = 1,
                   PDL: tl.constexpr = False):
        """A program per output tile; K in PARTS parts of KS columns (`matmul_invariant_split`), each summed from zero
        in its own fp32 accumulator, added in order ((p0 + p1) + p2) ... before the one rounding. PARTS = 1: one K
        loop (the loop is unrolled per part, so one part compiles to exactly the one-loop kernel)."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        for p in tl.static_range(PARTS):
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(p * KS, tl.minimum(K, p * KS + KS), BLOCK_K):  # one fixed K order within the part
                kk = k0 + offs_k
                a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :],
                            mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
                b = tl.load(b_ptr + offs_n[:, None] * stride_bn + kk[None, :],
                            mask=(offs_n[:, None] < N) & (kk[None, :] < K), other=0.0)
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            if p == 0:
                total = acc
            else:  # the partials path's order (`decode_gemm.sum_parts`)
                total = total + acc
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], total.to(c_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit(do_not_specialize=["M"])
    def _mm_silu_kernel(a_ptr, b_ptr, c_ptr, M, N, K, KS, stride_am, stride_bn, stride_cm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PARTS: tl.constexpr = 1, PDL: tl.constexpr = False):
        """`_mm_kernel` over a fused [gate | up] weight (rows 0..N-1 and N..2N-1) with SiLU(gate) * up as its
        epilogue: each output column's two products accumulate exactly as `_mm_kernel`'s (the same K parts and
        order, 64-row wgmma), are rounded to the output dtype as it stores them, and the epilogue is `silu_mul`'s
        arithmetic (launched, like it, without FMA contraction)."""
        if PDL:
            pdl_start()
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        for p in tl.static_range(PARTS):
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(p * KS, tl.minimum(K, p * KS + KS), BLOCK_K):
                kk = k0 + offs_k
                a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :],
                            mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
                bmask = (offs_n[:, None] < N) & (kk[None, :] < K)
                bg = tl.load(b_ptr + offs_n[:, None] * stride_bn + kk[None, :], mask=bmask, other=0.0)
                bu = tl.load(b_ptr + (N + offs_n[:, None]) * stride_bn + kk[None, :], mask=bmask, other=0.0)
                acc_g = tl.dot(a, tl.trans(bg), acc_g, input_precision="ieee")
                acc_u = tl.dot(a, tl.trans(bu), acc_u, input_precision="ieee")
            if p == 0:
                total_g = acc_g
                total_u = acc_u
            else:
                total_g = total_g + acc_g
                total_u = total_u + acc_u
        dt = c_ptr.dtype.element_ty
        g = total_g.to(dt).to(tl.float32)
        u = total_u.to(dt).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], (silu * u).to(dt),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def tiling_may_follow_m(device_index: int) -> bool:
    """Whether the tiling may follow M on this GPU (`matmul.tiling_follows_m`: the property `_mm_config` relies on
    was checked on Hopper only); elsewhere one tiling per weight shape."""
    return tuned("matmul.tiling_follows_m", chip_of(device_index))


def faster_than_cublas(x: Tensor) -> bool:
    """Whether `linear(x, w)` beats cuBLAS: up to `matmul.gemv_rows` rows (a decode step) on a GPU whose tiling
    follows M (Hopper); elsewhere every row count runs the pack tiling, made for many rows."""
    if not use_triton(x):
        return False
    chip = chip_of(x.device.index or 0)
    return x.numel() <= tuned("matmul.gemv_rows", chip) * x.shape[-1] and tuned("matmul.tiling_follows_m", chip)


def _mm_config(M: int, N: int, K: int, sms: int = 132, *, chip: str = HOPPER) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on `chip` (ops/tunables.py's `matmul.*`). Every tiling here
    has 64 rows per 4 warps, so Hopper runs it as 64-row wgmma (one per warpgroup) accumulating K in 16-wide steps in
    order into one fp32 accumulator: an element's value does not depend on BLOCK_N, BLOCK_K, stages or the number of
    warpgroups (`tests/test_batch_invariant_gpu.py` checks every pair bitwise), which is what lets the tiling follow
    M -- narrow N tiles for decode, 128x128 on 8 warps for packs -- and rows stay invariant. Where the tiling may not
    follow M (other GPUs): one tiling for every M.

    Decode rows are a GEMV with its weight read once from HBM: what bounds a launch is the bytes each SM keeps in
    flight, so a product whose output tiles fit on the `sms` SMs in one wave runs a deep pipeline (one CTA per SM),
    and wider products fewer stages, leaving room for a second CTA per SM (`matmul.decode_stages`)."""
    follow_m = tuned("matmul.tiling_follows_m", chip)
    if tuned("matmul.tiles", chip) == "large" or (M > tuned("matmul.decode_rows", chip) and follow_m):
        return tuned("matmul.pack_tiling", chip)  # packs and prefills on Hopper
    if not follow_m:  # other GPUs
        return tuned("matmul.fixed_tiling", chip)
    if N >= tuned("matmul.lm_head_min_n", chip):  # an LM head at decode rows
        return tuned("matmul.lm_head_tiling", chip)
    bm, bk, warps = tuned("matmul.decode_tile", chip)
    bn = threshold_pick(tuned("matmul.decode_block_n", chip), N)
    tiles = -(-M // bm) * -(-N // bn)
    stages = threshold_pick(tuned("matmul.decode_stages", chip), -(-tiles // sms))
    return bm, bn, bk, warps, stages


def _mm_triton(x: Tensor, w: Tensor, config: tuple[int, int, int, int, int] | None = None,
               parts: int | None = None) -> Tensor:
    """`_mm_kernel`, a program per output tile walking K's parts itself (the table's for K, or `parts`)."""
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    chip = launch_chip(x)
    P, ks = k_parts(K, chip, parts)
    bm, bn, bk, nw, ns = config or _mm_config(M, N, K, sm_count(x.device.index or 0), chip=chip)
    _mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, w, out, M, N, K, ks, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PARTS=P, num_warps=nw, num_stages=ns, **pdl_launch(x))
    return out


def _mm_cuda(x: Tensor, w: Tensor) -> Tensor:
    """The product on the GPU: a decode step's rows of a product with K parts whose tiles leave SMs idle as a
    program per (tile, part) and one sum (`matmul_invariant_split.partials_pay`), else `_mm_triton`; bitwise the
    same values either way."""
    M, K = x.shape
    N = w.shape[0]
    index = x.device.index or 0
    chip, sms = chip_of(index), sm_count(index)
    config = _mm_config(M, N, K, sms, chip=chip)
    P = k_parts(K, chip)[0]
    if partials_pay(M, N, triton.cdiv(M, config[0]) * triton.cdiv(N, config[1]), P, sms, chip):
        return sum_parts(partials(x, w, chip=chip), x.dtype)
    return _mm_triton(x, w, config)


def silu_mul_fusable(x: Tensor) -> bool:
    """Whether `mm_silu_mul` may stand in for `silu_mul(linear(x, w_gate), linear(x, w_up))`: where those products
    would run the Triton GEMM with its decode tiling (`faster_than_cublas`), outside autograd (it has no backward).
    A decode step then runs one launch for the gate/up product and the SiLU where it ran two."""
    return faster_than_cublas(x) and not torch.is_grad_enabled()


@custom_op("monorl::mm_silu_mul", mutates_args=())
def mm_silu_mul(x: Tensor, w: Tensor) -> Tensor:
    """SiLU(x @ w[:I]^T) * (x @ w[I:]^T) for a fused [gate | up] weight w [2I, K] -> [M, I] in x's dtype, bitwise
    what `block_kernels.silu_mul` gives on `bi_mm(x, w)`'s two column halves (CUDA; see `silu_mul_fusable`)."""
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0] // 2
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    return _mm_silu_triton(x, w, out)


def _mm_silu_triton(x: Tensor, w: Tensor, out: Tensor, config: tuple[int, int, int, int, int] | None = None,
                    parts: int | None = None) -> Tensor:
    """`_mm_silu_kernel` into out. Its K parts are the unfused products' (`k_parts` of K, whatever N), walked by each
    program (the many-rows structure): the epilogue needs both whole sums, so no program per part here."""
    M, K = x.shape
    N = out.shape[1]
    chip = launch_chip(x)
    P, ks = k_parts(K, chip, parts)
    # the unfused product's tiling (its programs and pipeline), each program's columns split into gate and up
    bm, bn, bk, nw, ns = config or _mm_config(M, 2 * N, K, sm_count(x.device.index or 0), chip=chip)
    bn = max(16, bn // 2)
    _mm_silu_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, w, out, M, N, K, ks, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PARTS=P, num_warps=nw, num_stages=ns, enable_fp_fusion=False, **pdl_launch(x))
    return out


@mm_silu_mul.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0] // 2)


def _mm_cpu(x: Tensor, w: Tensor) -> Tensor:
    M, K = x.shape
    N = w.shape[0]
    xf, wf = x.float(), w.float()
    rows = max(1, (1 << 22) // max(1, N * K))  # bound the [rows, N, K] product buffer (~16 MB)
    outs = [tree_sum(xf[s:s + rows, None, :] * wf[None]) for s in range(0, M, rows)]
    return (torch.cat(outs) if outs else xf.new_zeros(0, N)).to(x.dtype)


@custom_op("monorl::bi_mm", mutates_args=())
def bi_mm(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype; row i depends only on x[i] and w."""
    x, w = x.contiguous(), w.contiguous()
    return _mm_cuda(x, w) if use_triton(x) else _mm_cpu(x, w)


@bi_mm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def _mm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _mm_backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
    x, w = ctx.saved_tensors
    return grad @ w, grad.t() @ x


bi_mm.register_autograd(_mm_backward, setup_context=_mm_setup)


def mm_fp32(acc: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """acc + a @ b (a @ b when acc is None) in fp32 whatever a's and b's dtype (bf16): on CUDA one GEMM with an fp32
    output whose epilogue adds into acc in place, so no bf16 product is rounded in between."""
    if a.dtype == torch.float32:
        return a @ b if acc is None else acc.addmm_(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32) if acc is None else torch.addmm(
            acc, a, b, out_dtype=torch.float32, out=acc)
    a, b = a.float(), b.float()  # CPU has no mixed-dtype GEMM; bf16 operands are exact in fp32
    return a @ b if acc is None else acc.addmm_(a, b)


class _LinearFromMaster(torch.autograd.Function):
    """`bi_mm(x, w.to(x.dtype))` for an fp32 master weight w, whose weight gradient leaves its GEMM in fp32
    (`mm_fp32`). Through autograd the product's gradient was a bf16 GEMM output, rounded, then cast to fp32 by
    `ToCopyBackward0` (one more pass over each weight a micro-batch, ~310 launches a Qwen3-0.6B step)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor) -> Tensor:  # noqa: ANN001 - autograd's protocol
        wc = w.to(x.dtype)
        ctx.save_for_backward(x, wc)
        return bi_mm(x, wc)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # noqa: ANN001
        x, wc = ctx.saved_tensors
        gx = grad @ wc if ctx.needs_input_grad[0] else None
        gw = mm_fp32(None, grad.t(), x) if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear(x, weight) without bias, batch-invariant. The weight is cast to x's dtype (outside the op,
    so the trainer's fp32 master gets the gradient) -- exactly the generator's bf16 copy. A trainable fp32 master
    under a bf16 x gets its gradient in fp32 from the GEMM itself (`_LinearFromMaster`)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if weight.dtype == torch.float32 and x.dtype != torch.float32 and weight.requires_grad:
        out = _LinearFromMaster.apply(x2, weight)
    else:
        out = bi_mm(x2, weight.to(x.dtype))
    return out.view(*shape[:-1], weight.shape[0])
