"""Fused Triton kernels for a transformer block's elementwise work, so that an uncompiled forward replayed from a
CUDA graph launches about as few kernels as an Inductor-compiled one (the generator's decode step: ~50 small
kernels per layer eager, 10 with these):

- `add_rms_norm`: the residual add and the RMSNorm after it, one pass;
- `qk_norm_rope`: per-head RMSNorm of q and k and rotate-half RoPE, read straight from the fused q/k/v GEMM's
  output, one pass;
- `silu_mul`: SiLU(gate) * up from the fused gate/up GEMM's output.

Each rounds like the eager PyTorch ops it replaces (fp32 inside, the input dtype wherever eager stores a tensor),
so results differ from eager only in the order of the fp32 sum of squares. They launch with `enable_fp_fusion=False`:
otherwise RoPE's bf16-rounded products and their sum contract into one bf16 FMA on Hopper (one rounding instead of
three; 14% of q/k elements differed from eager on an H200). Every kernel is row-local (a token's
outputs read that token's inputs alone), so none depends on the batch. Each op is a custom op (opaque under
`torch.compile`) with a PyTorch fallback off CUDA, which is also the reference the GPU tests hold the kernels to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from monorl.ops import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, a_ptr, w_ptr, h_ptr, o_ptr, D, eps, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        h = (x + a).to(h_ptr.dtype.element_ty)  # eager's add rounds to the input dtype
        tl.store(h_ptr + row * D + offs, h, mask=mask)
        hf = h.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / D + eps)
        y = (hf * r).to(o_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * D + offs, (w * y.to(tl.float32)).to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_rope_heads(src, w_ptr, c1, c2, s1, s2, dst, eps, H: tl.constexpr, H_P: tl.constexpr,
                         D: tl.constexpr):
        """RMSNorm over each of H heads [D] at src (row stride D), then rotate-half RoPE; store at dst."""
        HALF: tl.constexpr = D // 2
        h = tl.arange(0, H_P)[:, None]
        d = tl.arange(0, HALF)[None, :]
        m = h < H
        x1 = tl.load(src + h * D + d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + h * D + HALF + d, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
        dt = dst.dtype.element_ty
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
        y1 = (w1 * (x1 * r[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y2 = (w2 * (x2 * r[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        # eager: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype
        o1 = ((y1 * c1).to(dt).to(tl.float32) - (y2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((y2 * c2).to(dt).to(tl.float32) + (y1 * s2).to(dt).to(tl.float32)).to(dt)
        tl.store(dst + h * D + d, o1, mask=m)
        tl.store(dst + h * D + HALF + d, o2, mask=m)

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_t, eps,
                             HQ: tl.constexpr, HKV: tl.constexpr, HQ_P: tl.constexpr, HKV_P: tl.constexpr,
                             D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        HALF: tl.constexpr = D // 2
        d = tl.arange(0, HALF)[None, :]
        c1 = tl.load(cos_ptr + t * D + d).to(tl.float32)
        c2 = tl.load(cos_ptr + t * D + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + t * D + d).to(tl.float32)
        s2 = tl.load(sin_ptr + t * D + HALF + d).to(tl.float32)
        src = qkv_ptr + t * stride_t
        _norm_rope_heads(src, qw_ptr, c1, c2, s1, s2, q_ptr + t * HQ * D, eps, HQ, HQ_P, D)
        _norm_rope_heads(src + HQ * D, kw_ptr, c1, c2, s1, s2, k_ptr + t * HKV * D, eps, HKV, HKV_P, D)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, o_ptr, N, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        g = tl.load(gu_ptr + t * 2 * N + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * 2 * N + N + offs, mask=m, other=0.0).to(tl.float32)
        dt = o_ptr.dtype.element_ty
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(o_ptr + t * N + offs, (s * u).to(dt), mask=m)


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """The model's RMSNorm (normalise in fp32, scale in x's dtype): the fallback's reference math."""
    xf = x.float()
    return w.to(x.dtype) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@torch.library.custom_op("monorl::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, a: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, rms_norm(h) * w) for h = x + a, over the last dim."""
    if not use_triton(x):
        h = x + a
        return h, _rms(h, w, eps)
    x, a = x.contiguous(), a.contiguous()
    D = x.shape[-1]
    h, out = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // D
    if rows:
        _add_rms_norm_kernel[(rows,)](x, a, w.contiguous(), h, out, D, eps, BLOCK_D=triton.next_power_of_2(D),
                                      num_warps=4 if D <= 2048 else 8, enable_fp_fusion=False)
    return h, out


@add_rms_norm.register_fake
def _(x, a, w, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None, :]


@torch.library.custom_op("monorl::qk_norm_rope", mutates_args=())
def qk_norm_rope(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float,
                 num_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """qkv [T, (Hq + 2 Hkv) * D] (q, k, v heads in that order) -> (q [T, Hq, D], k [T, Hkv, D]): per-head RMSNorm
    with q_weight / k_weight [D], then rotate-half RoPE with cos / sin [T, D]."""
    T = qkv.shape[0]
    D = cos.shape[-1]
    if not use_triton(qkv):
        q, k = qkv[:, :num_heads * D], qkv[:, num_heads * D:(num_heads + num_kv_heads) * D]
        q = _rms(q.reshape(T, num_heads, D), q_weight, eps)
        k = _rms(k.reshape(T, num_kv_heads, D), k_weight, eps)
        return _rope(q, cos, sin).to(qkv.dtype), _rope(k, cos, sin).to(qkv.dtype)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = qkv.new_empty(T, num_heads, D)
    k = qkv.new_empty(T, num_kv_heads, D)
    if T:
        _qk_norm_rope_kernel[(T,)](qkv, q_weight.contiguous(), k_weight.contiguous(), cos.contiguous(),
                                   sin.contiguous(), q, k, qkv.stride(0), eps, HQ=num_heads, HKV=num_kv_heads,
                                   HQ_P=triton.next_power_of_2(num_heads), HKV_P=triton.next_power_of_2(num_kv_heads),
                                   D=D, num_warps=4, enable_fp_fusion=False)
    return q, k


@qk_norm_rope.register_fake
def _(qkv, q_weight, k_weight, cos, sin, eps, num_heads, num_kv_heads):
    T, D = qkv.shape[0], cos.shape[-1]
    return qkv.new_empty(T, num_heads, D), qkv.new_empty(T, num_kv_heads, D)


@torch.library.custom_op("monorl::silu_mul", mutates_args=())
def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2 N] (gate columns, then up) -> SiLU(gate) * up [T, N]."""
    N = gate_up.shape[-1] // 2
    if not use_triton(gate_up):
        gate, up = gate_up.split([N, N], dim=-1)
        return F.silu(gate) * up
    gate_up = gate_up.contiguous()
    T = gate_up.numel() // (2 * N)
    out = gate_up.new_empty(*gate_up.shape[:-1], N)
    if T:
        block = 1024
        _silu_mul_kernel[(T, triton.cdiv(N, block))](gate_up, out, N, BLOCK=block, num_warps=4,
                                                      enable_fp_fusion=False)
    return out


@silu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

