"""Qwen3.5's gated RMSNorm (`monorl.model.qwen3_5.GatedRMSNorm`: w * norm(x) rounded to x's dtype, times SiLU(gate)
in fp32, rounded) in one Triton kernel, for the generator's CUDA copy (`monorl.model.fused_kernels.use_fused_norms_`).

Why: eagerly it is ten PyTorch kernels (casts, pow, mean, rsqrt, the products, SiLU), once per Gated DeltaNet layer
and decode step; a Qwen3.5-0.8B generation of 100 tokens at 40 rows ran ~770 kernels a step, 370 ms of GPU time in
all (prefill included), where a decode step's bytes floor is ~1 ms (H100, 2026-12-07, `profile_rl_step.py`).
Forward only (the generator has no gradient); the trainer keeps the module's own path, and batch-invariant mode its
own norm (`BatchInvariantGatedRMSNorm`)."""

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
    def _gated_rms_kernel(x_ptr, g_ptr, w_ptr, o_ptr, D, stride_x, stride_g, eps, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr = False):
        """One row: the module's roundings (the norm to x's dtype, the weight's product to it, then the gated one)."""
        if PDL:
            pdl_start()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        dt = o_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        n = (x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))).to(dt).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = (w * n).to(dt).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * D + offs, (h * (g / (1.0 + tl.exp(-g)))).to(dt), mask=mask)


def gated_rms_norm_reference(x: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
    """The module's math in PyTorch ops (differentiable): `GatedRMSNorm.forward`, and the op off CUDA."""
    h = x.float()
    h = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * torch.nn.functional.silu(gate.float())).to(x.dtype)


def launch(x: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
    """The kernel over rows of x and gate [R, D] (unit last stride, any row stride) -> [R, D] in x's dtype."""
    R, D = x.shape
    out = torch.empty((R, D), dtype=x.dtype, device=x.device)
    if R:
        _gated_rms_kernel[(R,)](x, gate, w.contiguous(), out, D, x.stride(0), gate.stride(0), eps,
                                BLOCK_D=triton.next_power_of_2(D), num_warps=tuned("rmsnorm.warps", chip_for(x)),
                                **pdl_launch(x))
    return out


@custom_op("monorl::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
    """w * norm(x) * SiLU(gate) over the last dim as `GatedRMSNorm` rounds it: one program a row on CUDA, the
    reference elsewhere. x, gate [..., D] of one shape."""
    if not use_triton(x) or x.numel() == 0 or w.dtype != x.dtype:
        return gated_rms_norm_reference(x, gate, w, eps)
    D = x.shape[-1]
    rows = [t if t.dim() == 2 and t.stride(-1) == 1 else t.reshape(-1, D).contiguous() for t in (x, gate)]
    return launch(*rows, w, eps).view(x.shape)


@gated_rms_norm.register_fake
def _(x: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)
