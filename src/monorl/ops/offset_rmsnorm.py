"""The (1 + w) RMSNorm of Gemma 3 and Qwen3.5 (`monorl.model.layers.OffsetRMSNorm`: normalise in fp32, scale by
1 + w in fp32, then round) in one Triton kernel, for the generator's CUDA copy (`monorl.model.fused_kernels.
use_fused_norms_`). Those families run their own decoder layers, so the fused block kernels do not reach them, and
each norm ran as ~8 PyTorch kernels: a Gemma 3 270M decode step (64 rows, 16k context, window on, H100, 2026-12-07)
spent ~2.3 of its 5.1 GPU ms in the elementwise kernels of its 108 norms, against a 1.3 ms bytes floor. Forward
only (the generator has no gradient); the trainer keeps the module's own path.

`offset_add_norm` is Gemma 3's seam between two sub-layers (`monorl.model.gemma3_fused`): the post-norm of a
sub-layer's output, the residual add and the next pre-norm, one kernel where they were three. `offset_residual_norm`
is Qwen3.5's (no post-norm): the residual add and the next pre-norm, the same kernel without its first norm."""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, custom_op, pdl_launch, use_triton
from monorl.ops.tunables import chip_for, tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit
    def _offset_rms_kernel(x_ptr, w_ptr, o_ptr, D, stride_x, eps, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * D + offs, (x * r * (1.0 + w)).to(o_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _offset_add_norm_kernel(x_ptr, a_ptr, wa_ptr, wh_ptr, h_ptr, o_ptr, D, stride_a, eps, BLOCK_D: tl.constexpr,
                                NORM_A: tl.constexpr = True, PDL: tl.constexpr = False):
        """h = x + norm(a) * (1 + wa) (NORM_A; else h = x + a, wa unused), n = norm(h) * (1 + wh): each rounded to
        x's dtype where eager rounds."""
        if PDL:
            pdl_start()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        dt = h_ptr.dtype.element_ty
        a = tl.load(a_ptr + row * stride_a + offs, mask=mask, other=0.0).to(tl.float32)
        if NORM_A:
            wa = tl.load(wa_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = (a * (1.0 / tl.sqrt(tl.sum(a * a, axis=0) / D + eps)) * (1.0 + wa)).to(dt)
        else:
            y = a.to(dt)
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0)
        h = (x.to(tl.float32) + y.to(tl.float32)).to(dt)  # eager's add rounds to the dtype
        tl.store(h_ptr + row * D + offs, h, mask=mask)
        hf = h.to(tl.float32)
        wh = tl.load(wh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        n = hf * (1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / D + eps)) * (1.0 + wh)
        tl.store(o_ptr + row * D + offs, n.to(dt), mask=mask)


def offset_rms_norm_reference(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """The norm's math, in PyTorch ops (differentiable): `OffsetRMSNorm.forward`, and the op off CUDA."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + w.float())).to(x.dtype)


@custom_op("monorl::offset_rms_norm", mutates_args=())
def offset_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x / rms(x) * (1 + w) over the last dim, in fp32, rounded to x's dtype: one program a row on CUDA (rows of
    x may be strided: a fused projection's column slice), the reference elsewhere."""
    D = x.shape[-1]
    if not use_triton(x) or x.numel() == 0:
        return offset_rms_norm_reference(x, w, eps)
    rows = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, D).contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _offset_rms_kernel[(rows.shape[0],)](rows, w.contiguous(), out, D, rows.stride(0), eps,
                                         BLOCK_D=triton.next_power_of_2(D),
                                         num_warps=tuned("rmsnorm.warps", chip_for(x)), **pdl_launch(x))
    return out.view(x.shape)


@offset_rms_norm.register_fake
def _(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@custom_op("monorl::offset_add_norm", mutates_args=())
def offset_add_norm(x: Tensor, a: Tensor, wa: Tensor, wh: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, n) for h = x + (1 + wa)-norm(a) and n = (1 + wh)-norm(h), rows of the last dim, each norm in fp32 and
    rounded to x's dtype, the add rounded too (as the eager ops: `offset_rms_norm_reference`). x [T, D] contiguous; a
    [T, D] with unit last stride (a projection's output)."""
    if not use_triton(x) or x.numel() == 0:
        h = x + offset_rms_norm_reference(a, wa, eps)
        return h, offset_rms_norm_reference(h, wh, eps)
    return _add_norm_triton(x, a, wa, wh, eps, norm_a=True)


def _add_norm_triton(x: Tensor, a: Tensor, wa: Tensor, wh: Tensor, eps: float, norm_a: bool) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    T, D = x.shape
    h, n = torch.empty_like(x), torch.empty_like(x)
    _offset_add_norm_kernel[(T,)](x, a, wa.contiguous(), wh.contiguous(), h, n, D, a.stride(0), eps,
                                  BLOCK_D=triton.next_power_of_2(D), NORM_A=norm_a,
                                  num_warps=tuned("rmsnorm.warps", chip_for(x)), **pdl_launch(x))
    return h, n


@offset_add_norm.register_fake
def _(x, a, wa, wh, eps):
    return torch.empty_like(x), torch.empty_like(x)


@custom_op("monorl::offset_residual_norm", mutates_args=())
def offset_residual_norm(x: Tensor, a: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, n) for h = x + a (rounded to x's dtype, as eager's add) and n = (1 + w)-norm(h): Qwen3.5's seam between
    a sub-layer's output and the next pre-norm (`monorl.model.qwen3_5_fused`), one kernel where it was two. x [T, D]
    contiguous; a [T, D] with unit last stride."""
    if not use_triton(x) or x.numel() == 0:
        h = x + a
        return h, offset_rms_norm_reference(h, w, eps)
    return _add_norm_triton(x, a, w, w, eps, norm_a=False)


@offset_residual_norm.register_fake
def _(x, a, w, eps):
    return torch.empty_like(x), torch.empty_like(x)
