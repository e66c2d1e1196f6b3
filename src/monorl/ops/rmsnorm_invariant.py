"""Batch-invariant RMSNorm: one program (CUDA) or one fixed tree sum (CPU) per row, the same rounding as the
model's RMSNorm (normalise in fp32, scale in the input's dtype). Backward is ordinary math: on CUDA one fused
kernel (`rms_norm_backward`, shared with the fused block kernels' backward: with RoPE's and a residual's gradient
folded in), so an uncompiled trainer step does not spend ~100 ms of a Qwen3-0.6B step in a dozen elementwise
passes per norm. It needs no batch invariance (only forwards are compared), but it is deterministic: the weight's
gradient sums fixed blocks of rows, then those partial sums in a fixed order."""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, custom_op, pdl_launch, sm_count, unit_stride, use_triton
from monorl.ops.tree_sum import tree_sum
from monorl.ops.tunables import HOPPER, chip_for, tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit
    def _rms_kernel(x_ptr, w_ptr, o_ptr, D, eps, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = (x * r).to(o_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(o_ptr + row * D + offs, (w.to(tl.float32) * y.to(tl.float32)).to(o_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit(do_not_specialize=["R", "H"])
    def _rms_backward_kernel(x_ptr, w_ptr, g_ptr, res_ptr, cos_ptr, sin_ptr, gx_ptr, gw_ptr, R, H, stride_x, eps,
                             D: tl.constexpr, HALF_P: tl.constexpr, TILE: tl.constexpr,
                             HAS_RES: tl.constexpr, ROPE: tl.constexpr):
        """Tiles of TILE rows of D, each a [TILE, D / 2] tile per half (a q/k norm's rows of 128 are too short to
        fill the warps one by one), walked grid-stride: program p takes tiles p, p + programs, ...; row = token *
        H + head (x's token rows stride_x apart, heads side by side; g, res and gx contiguous rows). Each row in
        two halves, RoPE's pairing; the weight's partial sum of this program's rows goes to gw[program]."""
        pid = tl.program_id(0)
        HALF: tl.constexpr = D // 2
        d = tl.arange(0, HALF_P)
        m = d < HALF
        w1 = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=m, other=0.0).to(tl.float32)[None, :]
        acc1 = tl.zeros([TILE, HALF_P], dtype=tl.float32)
        acc2 = tl.zeros([TILE, HALF_P], dtype=tl.float32)
        dt = gx_ptr.dtype.element_ty
        for tile in range(pid, tl.cdiv(R, TILE), tl.num_programs(0)):
            row = (tile * TILE + tl.arange(0, TILE)).to(tl.int64)  # tile * TILE < R
            mr = m[None, :] & (row < R)[:, None]
            t = row // H
            xb = (x_ptr + t * stride_x + (row - t * H) * D)[:, None] + d[None, :]
            gb = (row * D)[:, None] + d[None, :]
            x1 = tl.load(xb, mask=mr, other=0.0).to(tl.float32)
            x2 = tl.load(xb + HALF, mask=mr, other=0.0).to(tl.float32)
            g1 = tl.load(g_ptr + gb, mask=mr, other=0.0).to(tl.float32)
            g2 = tl.load(g_ptr + gb + HALF, mask=mr, other=0.0).to(tl.float32)
            if ROPE:  # the gradient through out = x * cos + cat(-x2, x1) * sin
                cb = (t * D)[:, None] + d[None, :]
                c1 = tl.load(cos_ptr + cb, mask=mr, other=0.0).to(tl.float32)
                c2 = tl.load(cos_ptr + cb + HALF, mask=mr, other=0.0).to(tl.float32)
                s1 = tl.load(sin_ptr + cb, mask=mr, other=0.0).to(tl.float32)
                s2 = tl.load(sin_ptr + cb + HALF, mask=mr, other=0.0).to(tl.float32)
                g1, g2 = g1 * c1 + g2 * s2, g2 * c2 - g1 * s1
            r = (1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps))[:, None]
            y1 = x1 * r
            y2 = x2 * r
            gy1 = g1 * w1
            gy2 = g2 * w2
            c = ((tl.sum(gy1 * y1, axis=1) + tl.sum(gy2 * y2, axis=1)) / D)[:, None]
            gx1 = r * (gy1 - y1 * c)
            gx2 = r * (gy2 - y2 * c)
            if HAS_RES:  # x also fed the residual stream: its gradient joins before the rounding
                gx1 += tl.load(res_ptr + gb, mask=mr, other=0.0).to(tl.float32)
                gx2 += tl.load(res_ptr + gb + HALF, mask=mr, other=0.0).to(tl.float32)
            tl.store(gx_ptr + gb, gx1.to(dt), mask=mr)
            tl.store(gx_ptr + gb + HALF, gx2.to(dt), mask=mr)
            acc1 += g1 * y1.to(dt).to(tl.float32)  # the forward scales the rounded normalised row
            acc2 += g2 * y2.to(dt).to(tl.float32)
        tl.store(gw_ptr + pid * D + d, tl.sum(acc1, axis=0), mask=m)
        tl.store(gw_ptr + pid * D + HALF + d, tl.sum(acc2, axis=0), mask=m)

    @triton.jit
    def _sum_rows_kernel(p_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[d] = the sum over rows of p [P, D] (fp32), BLOCK_D columns a program, rows in one fixed order."""
        cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
        mc = cols < D
        acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
        for s in range(0, P, BLOCK_P):
            r = s + tl.arange(0, BLOCK_P)
            acc += tl.load(p_ptr + r[:, None] * D + cols[None, :], mask=(r < P)[:, None] & mc[None, :], other=0.0)
        tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=mc)


@custom_op("monorl::bi_rms_norm", mutates_args=())
def bi_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim (normalise in fp32, scale in x's dtype), one fixed order per row."""
    x = x.contiguous()
    D = x.shape[-1]
    if use_triton(x):
        out = torch.empty_like(x)
        rows = x.numel() // D
        if rows:
            _rms_kernel[(rows,)](x, w.contiguous(), out, D, eps, BLOCK_D=triton.next_power_of_2(D),
                                 num_warps=tuned("rmsnorm.warps", chip_for(x)), **pdl_launch(x))
        return out
    return rms_norm_rows(x, w, eps)


@bi_rms_norm.register_fake
def _(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


def _rms_setup(ctx, inputs, output) -> None:
    x, w, eps = inputs
    ctx.save_for_backward(x, w)
    ctx.eps = eps


def rms_norm_rows(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """The CPU path, also the fused block kernels' fallback: w * rms_norm(x) over the last dim with one fixed tree
    sum per row (normalise in fp32, scale in x's dtype)."""
    xf = x.float()
    r = torch.rsqrt(tree_sum(xf * xf)[..., None] / x.shape[-1] + eps)
    return w.to(x.dtype) * (xf * r).to(x.dtype)


def _rope_backward(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The gradient of RoPE's input (`rope.apply_rope`) from its output's g [T, H, D] (fp32): g * cos
    + rotate-half's transpose of g * sin."""
    half = g.shape[-1] // 2
    u = g * sin[:, None, :].float()
    return g * cos[:, None, :].float() + torch.cat((u[..., half:], -u[..., :half]), dim=-1)


def _backward_launch(R: int, half_p: int, sms: int, *, chip: str = HOPPER) -> tuple[int, int, int]:
    """(programs, rows a tile, warps) of the backward kernel: tiles of `rmsnorm.backward_tile_elements` a half, at
    most `backward_programs_per_sm` programs an SM, each walking its share of the tiles. The weight's gradient is then
    summed over at most that many partials (`sum_rows`), not one per 16 rows: ATen's column sum of 576 partials of
    1024 took 45 us, about what a norm's whole backward should (RESULTS.md, 2026-11-25 evening)."""
    tile = max(1, tuned("rmsnorm.backward_tile_elements", chip) // half_p)
    # none for no rows: the sum of no partials is 0
    programs = min(-(-R // tile), tuned("rmsnorm.backward_programs_per_sm", chip) * sms)
    return programs, tile, tuned("rmsnorm.backward_warps", chip)


def sum_rows(p: Tensor) -> Tensor:
    """p [P, D] fp32 summed over rows in one fixed order (CUDA: `_sum_rows_kernel`), [D] fp32."""
    P, D = p.shape
    if not use_triton(p) or P == 0:
        return p.sum(0)
    out = torch.empty(D, dtype=torch.float32, device=p.device)
    block_p, widest, warps = tuned("rmsnorm.sum_rows_block", chip_for(p))
    block_d = min(widest, triton.next_power_of_2(D))
    _sum_rows_kernel[(triton.cdiv(D, block_d),)](p, out, P, D, BLOCK_P=block_p, BLOCK_D=block_d, num_warps=warps)
    return out


@custom_op("monorl::rms_norm_backward", mutates_args=())
def _rms_norm_backward(x: Tensor, w: Tensor, grad: Tensor, grad_residual: Tensor | None, cos: Tensor | None,
                       sin: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    D = w.shape[0]
    if not use_triton(x) or D % 2:  # the kernel walks a row in RoPE's two halves
        xf = x.float().reshape(-1, x.shape[-1] // D, D)
        g = grad.float().reshape(xf.shape)
        if cos is not None:
            g = _rope_backward(g, cos, sin)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = xf * r
        gy = g * w.float()
        gx = r * (gy - y * (gy * y).mean(-1, keepdim=True))
        if grad_residual is not None:
            gx = gx + grad_residual.float().reshape(gx.shape)
        gw = (g * y.to(x.dtype).float()).reshape(-1, D).sum(0)
        return gx.to(x.dtype).reshape(x.shape), gw.to(w.dtype)
    xs = unit_stride(x).reshape(-1, x.shape[-1])  # token rows may be strided (a fused GEMM's column slice)
    T, H = xs.shape[0], x.shape[-1] // D
    R = T * H
    g = grad.contiguous()
    gx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half_p = triton.next_power_of_2(D // 2)
    programs, tile, warps = _backward_launch(R, half_p, sm_count(x.device.index or 0), chip=chip_for(x))
    gw = torch.empty(programs, D, dtype=torch.float32, device=x.device)  # every program has a tile
    if R:
        res = g if grad_residual is None else grad_residual.contiguous()
        rc, rs = (g, g) if cos is None else (cos.contiguous(), sin.contiguous())
        _rms_backward_kernel[(programs,)](xs, w.contiguous(), g, res, rc, rs, gx, gw, R, H, xs.stride(0), eps, D=D,
                                          HALF_P=half_p, TILE=tile, HAS_RES=grad_residual is not None,
                                          ROPE=cos is not None, num_warps=warps)
    return gx, sum_rows(gw).to(w.dtype)


@_rms_norm_backward.register_fake
def _(x, w, grad, grad_residual, cos, sin, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), w.new_empty(w.shape)


def rms_norm_backward(x: Tensor, w: Tensor, grad: Tensor, eps: float, grad_residual: Tensor | None = None,
                      rope: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Ordinary-math backward of w * rms_norm(x) over each D = len(w) slice of x's last dim: (grad of x in x's
    dtype, grad of w in w's dtype, summed over every row). `grad_residual` (x's shape) is added to x's gradient in
    fp32 before the rounding (x also fed a residual stream); `rope=(cos, sin)` [T, D] means the norm's output went
    through RoPE (x [T, H * D], grad [T, H, D]) and grad is RoPE's output gradient."""
    cos, sin = rope if rope is not None else (None, None)
    return _rms_norm_backward(x, w, grad, grad_residual, cos, sin, eps)


def _rms_backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    x, w = ctx.saved_tensors
    gx, gw = rms_norm_backward(x, w, grad, ctx.eps)
    return gx, gw, None


bi_rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return bi_rms_norm(x, weight.to(x.dtype), eps)
