"""Batch-invariant RMSNorm: one program (CUDA) or one fixed tree sum (CPU) per row, the same rounding as the
model's RMSNorm (normalise in fp32, scale in the input's dtype). Backward is ordinary math."""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, use_triton
from monorl.ops.tree_sum import tree_sum

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_kernel(x_ptr, w_ptr, o_ptr, D, eps, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = (x * r).to(o_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(o_ptr + row * D + offs, (w.to(tl.float32) * y.to(tl.float32)).to(o_ptr.dtype.element_ty),
                 mask=mask)


@torch.library.custom_op("monorl::bi_rms_norm", mutates_args=())
def bi_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim (normalise in fp32, scale in x's dtype), one fixed order per row."""
    x = x.contiguous()
    D = x.shape[-1]
    if use_triton(x):
        out = torch.empty_like(x)
        rows = x.numel() // D
        if rows:
            _rms_kernel[(rows,)](x, w.contiguous(), out, D, eps, BLOCK_D=triton.next_power_of_2(D), num_warps=4)
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


def rms_norm_backward(x: Tensor, w: Tensor, grad: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Ordinary-math backward of w * rms_norm(x) over the last dim: (grad of x, grad of w), both fp32; the weight's
    summed over every leading dim."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * r
    gy = grad.float() * w.float()
    gx = r * (gy - y * (gy * y).mean(-1, keepdim=True))
    gw = (grad.float() * y.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    return gx, gw


def _rms_backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    x, w = ctx.saved_tensors
    gx, gw = rms_norm_backward(x, w, grad, ctx.eps)
    return gx.to(x.dtype), gw.to(w.dtype), None


bi_rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return bi_rms_norm(x, weight.to(x.dtype), eps)
