"""Fused Triton kernels for a transformer block's elementwise work, so that an uncompiled forward replayed from a
CUDA graph launches about as few kernels as an Inductor-compiled one (the generator's decode step: ~50 small
kernels per layer eager, 10 with these):

- `add_rms_norm`: the residual add and the RMSNorm after it, one pass;
- `qk_norm_rope`: per-head RMSNorm of q and k and rotate-half RoPE, one pass (reading a fused q/k/v GEMM's
  output in place); `qk_norm_rope_write_kv` also writes k and v to the generator's KV cache in that pass;
- `silu_mul`: SiLU(gate) * up (reading a fused gate/up GEMM's output in place);
- Gemma 3's forward-only forms for the generator's copy (`monorl.model.gemma3_fused`): `offset_qk_norm_rope_write_kv`
  (the (1 + w) q/k norm) and `gelu_tanh_mul` (GeGLU); Qwen3.5's gated attention runs that q/k op too, with its
  partial RoPE and each query read from beside its output gate (`q_head_stride`).

Each rounds like the eager PyTorch ops it replaces (fp32 inside, the input dtype wherever eager stores a tensor),
so results differ from eager only in the order of the fp32 sum of squares. They launch with `enable_fp_fusion=False`:
otherwise RoPE's bf16-rounded products and their sum contract into one bf16 FMA on Hopper (one rounding instead of
three; 14% of q/k elements differed from eager on an H200). Every kernel is row-local (a token's
outputs read that token's inputs alone), so none depends on the batch. Each op is a custom op (opaque under
`torch.compile`) with a PyTorch fallback off CUDA, which is also the reference the GPU tests hold the kernels to;
the fallbacks sum squares in `tree_sum`'s fixed order, so they are batch-invariant too. Each has an ordinary-math
backward, itself one fused kernel on CUDA (the norms' in `rmsnorm_invariant.rms_norm_backward`), so a trainer's
model runs them as well: a batch-invariant run converts both of its models to them
(`monorl.model.batch_invariant`), and generator and trainer then share every elementwise kernel of a block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from monorl.ops import HAS_TRITON, custom_op, pdl_launch, unit_stride, use_triton
from monorl.ops.decode_gemm import sum_parts
from monorl.ops.offset_rmsnorm import offset_rms_norm_reference
from monorl.ops.rmsnorm_invariant import rms_norm_backward, rms_norm_rows
from monorl.ops.rope import partial_rope
from monorl.ops.tunables import chip_for, threshold_pick, tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, a_ptr, w_ptr, h_ptr, o_ptr, D, eps, part_stride, BLOCK_D: tl.constexpr,
                             PARTS: tl.constexpr = 0, PDL: tl.constexpr = False):
        """PARTS > 0: the addend is a split-K product's PARTS fp32 parts (`decode_gemm.split_k_parts`, part_stride
        apart), summed in order and rounded to x's dtype first, as `decode_gemm.sum_parts`."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        if PARTS:
            a = tl.load(a_ptr + row * D + offs, mask=mask, other=0.0)
            for i in tl.static_range(1, PARTS):
                a += tl.load(a_ptr + i * part_stride + row * D + offs, mask=mask, other=0.0)
            a = a.to(h_ptr.dtype.element_ty).to(tl.float32)
        else:
            a = tl.load(a_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        h = (x + a).to(h_ptr.dtype.element_ty)  # eager's add rounds to the input dtype
        tl.store(h_ptr + row * D + offs, h, mask=mask)
        hf = h.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / D + eps)
        y = (hf * r).to(o_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * D + offs, (w * y.to(tl.float32)).to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_rope_heads(src, w_ptr, c1, c2, s1, s2, dst, dst2, eps, H: tl.constexpr, H_P: tl.constexpr,
                         D: tl.constexpr, R: tl.constexpr, HS: tl.constexpr, STORE2: tl.constexpr,
                         OFFSET: tl.constexpr = False):
        """RMSNorm over each of H heads [D] at src (heads HS apart), then rotate-half RoPE of each head's first R
        dims (R < D: the rest pass through, normed only: Qwen3.5's partial rotary); store at dst (and, if STORE2,
        at dst2 in its dtype: a KV-cache slot). OFFSET: the (1 + w) norm (`offset_rmsnorm`: normed and scaled in
        fp32, rounded once) where Qwen3's rounds the normed row before w."""
        HALF: tl.constexpr = R // 2
        h = tl.arange(0, H_P)[:, None]
        d = tl.arange(0, HALF)[None, :]
        m = h < H
        x1 = tl.load(src + h * HS + d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + h * HS + HALF + d, mask=m, other=0.0).to(tl.float32)
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if R < D:  # the unrotated dims, as a [H_P, D] tile masked to R.. (R == D: not traced, the sum as it was)
            p = tl.arange(0, D)[None, :]
            mp = m & (p >= R)
            x3 = tl.load(src + h * HS + p, mask=mp, other=0.0).to(tl.float32)
            ss += tl.sum(x3 * x3, axis=1)
        r = 1.0 / tl.sqrt(ss / D + eps)
        dt = dst.dtype.element_ty
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
        if OFFSET:
            y1 = (x1 * r[:, None] * (1.0 + w1)).to(dt).to(tl.float32)
            y2 = (x2 * r[:, None] * (1.0 + w2)).to(dt).to(tl.float32)
        else:
            y1 = (w1 * (x1 * r[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            y2 = (w2 * (x2 * r[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        # eager: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype
        o1 = ((y1 * c1).to(dt).to(tl.float32) - (y2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((y2 * c2).to(dt).to(tl.float32) + (y1 * s2).to(dt).to(tl.float32)).to(dt)
        tl.store(dst + h * D + d, o1, mask=m)
        tl.store(dst + h * D + HALF + d, o2, mask=m)
        if STORE2:
            tl.store(dst2 + h * D + d, o1.to(dst2.dtype.element_ty), mask=m)
            tl.store(dst2 + h * D + HALF + d, o2.to(dst2.dtype.element_ty), mask=m)
        if R < D:
            w3 = tl.load(w_ptr + p, mask=p >= R, other=0.0).to(tl.float32)
            if OFFSET:
                o3 = (x3 * r[:, None] * (1.0 + w3)).to(dt)
            else:
                o3 = (w3 * (x3 * r[:, None]).to(dt).to(tl.float32)).to(dt)
            tl.store(dst + h * D + p, o3, mask=mp)
            if STORE2:
                tl.store(dst2 + h * D + p, o3.to(dst2.dtype.element_ty), mask=mp)

    @triton.jit
    def _qk_norm_rope_kernel(qi_ptr, ki_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_q, stride_k,
                             v_ptr, stride_v, kc_ptr, vc_ptr, slot_ptr, eps, HQ: tl.constexpr, HKV: tl.constexpr,
                             HQ_P: tl.constexpr, HKV_P: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                             Q_HS: tl.constexpr, WRITE_KV: tl.constexpr, SPLIT: tl.constexpr = False,
                             OFFSET: tl.constexpr = False, PDL: tl.constexpr = False):
        """One token's q and k heads normed and rotated (RoPE over each head's first R dims, cos / sin [T, R]; q's
        heads Q_HS apart: 2 * D where each head's query sits beside its output gate); with WRITE_KV, its k (as
        returned) and v also stored at its KV-cache slot (kc_ptr / vc_ptr: [slots, HKV, D]), so the generator needs
        no separate cache write. SPLIT (few tokens: a decode step): program (t, 0) does the q heads and (t, 1) the
        k heads, two short chains side by side (40 tokens: 2.42 -> 1.95 us a launch, H200); each is the same code
        on the same tile either way, so the values do not depend on it."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        t = tl.program_id(0).to(tl.int64)
        HALF: tl.constexpr = R // 2
        d = tl.arange(0, HALF)[None, :]
        c1 = tl.load(cos_ptr + t * R + d).to(tl.float32)
        c2 = tl.load(cos_ptr + t * R + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + t * R + d).to(tl.float32)
        s2 = tl.load(sin_ptr + t * R + HALF + d).to(tl.float32)
        if not SPLIT or tl.program_id(1) == 0:
            _norm_rope_heads(qi_ptr + t * stride_q, qw_ptr, c1, c2, s1, s2, q_ptr + t * HQ * D, q_ptr, eps, HQ, HQ_P,
                             D, R, Q_HS, False, OFFSET)
        if not SPLIT or tl.program_id(1) == 1:
            slot = tl.load(slot_ptr + t).to(tl.int64) if WRITE_KV else t
            _norm_rope_heads(ki_ptr + t * stride_k, kw_ptr, c1, c2, s1, s2, k_ptr + t * HKV * D,
                             kc_ptr + slot * HKV * D, eps, HKV, HKV_P, D, R, D, WRITE_KV, OFFSET)
            if WRITE_KV:
                h = tl.arange(0, HKV_P)[:, None]
                dd = tl.arange(0, D)[None, :]
                v = tl.load(v_ptr + t * stride_v + h * D + dd, mask=h < HKV)
                tl.store(vc_ptr + slot * HKV * D + h * D + dd, v.to(vc_ptr.dtype.element_ty), mask=h < HKV)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        g = tl.load(g_ptr + t * stride_g + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + t * stride_u + offs, mask=m, other=0.0).to(tl.float32)
        dt = o_ptr.dtype.element_ty
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(o_ptr + t * N + offs, (s * u).to(dt), mask=m)

    @triton.jit
    def _silu_mul_backward_kernel(d_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        d = tl.load(d_ptr + t * N + offs, mask=m, other=0.0).to(tl.float32)
        x = tl.load(g_ptr + t * stride_g + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + t * stride_u + offs, mask=m, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-x))
        tl.store(dg_ptr + t * N + offs, (d * u * s * (1 + x * (1 - s))).to(dg_ptr.dtype.element_ty), mask=m)
        tl.store(du_ptr + t * N + offs, (d * x * s).to(du_ptr.dtype.element_ty), mask=m)


    @triton.jit
    def _gelu_tanh_mul_kernel(g_ptr, u_ptr, o_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr,
                              PDL: tl.constexpr = False):
        if PDL:
            pdl_start()
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        g = tl.load(g_ptr + t * stride_g + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + t * stride_u + offs, mask=m, other=0.0).to(tl.float32)
        dt = o_ptr.dtype.element_ty
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (x + 0.044715 x^3)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # (saturates to +-1, no inf / inf)
        a = (0.5 * g * (1.0 + tanh)).to(dt).to(tl.float32)
        tl.store(o_ptr + t * N + offs, (a * u).to(dt), mask=m)


@custom_op("monorl::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, a: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, rms_norm(h) * w) for h = x + a, over the last dim; w in x's dtype."""
    if not use_triton(x):
        h = x + a
        return h, rms_norm_rows(h, w, eps)
    return _add_rms_norm_triton(x, a, w, eps, parts=0)


def _add_rms_norm_triton(x: Tensor, a: Tensor, w: Tensor, eps: float, parts: int) -> tuple[Tensor, Tensor]:
    """One `_add_rms_norm_kernel` launch; parts > 0: a is a split-K product's fp32 parts [parts, *x.shape]."""
    x, a = x.contiguous(), a.contiguous()
    D = x.shape[-1]
    h, out = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // D
    if rows:
        warps = threshold_pick(tuned("block.norm_warps", chip_for(x)), D)
        _add_rms_norm_kernel[(rows,)](x, a, w.contiguous(), h, out, D, eps, rows * D,
                                      BLOCK_D=triton.next_power_of_2(D), PARTS=parts, num_warps=warps,
                                      enable_fp_fusion=False, **pdl_launch(x))
    return h, out


@add_rms_norm.register_fake
def _(x, a, w, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _add_rms_norm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[0], inputs[2])
    ctx.eps = inputs[3]


def _add_rms_norm_backward(ctx, grad_h: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
    h, w = ctx.saved_tensors
    g, gw = rms_norm_backward(h, w, grad_out, ctx.eps, grad_residual=grad_h)  # h feeds the norm and the residual
    return g, g, gw, None


add_rms_norm.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup)


@custom_op("monorl::add_parts_rms_norm", mutates_args=())
def add_parts_rms_norm(x: Tensor, parts: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`add_rms_norm` whose addend is a split-K product's fp32 parts [P, *x.shape] (`decode_gemm.split_k_parts`,
    summed as `decode_gemm.sum_parts`). No backward: decode steps only."""
    if not use_triton(x):
        h = x + sum_parts(parts, x.dtype)
        return h, rms_norm_rows(h, w, eps)
    return _add_rms_norm_triton(x, parts, w, eps, parts=parts.shape[0])


@add_parts_rms_norm.register_fake
def _(x, parts, w, eps):
    return torch.empty_like(x), torch.empty_like(x)


def write_kv(k: Tensor, v: Tensor, cache: Tensor, slots: Tensor) -> None:
    """k, v [T, Hkv, D] to `cache` [2, ..., Hkv, D] at flat token slots [T] (PyTorch: two index copies)."""
    Hkv, D = cache.shape[-2:]
    cache[0].view(-1, Hkv, D).index_copy_(0, slots, k.to(cache.dtype))
    cache[1].view(-1, Hkv, D).index_copy_(0, slots, v.to(cache.dtype))


def _qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float,
                  kv: tuple[Tensor, Tensor, Tensor] | None = None, offset: bool = False,
                  q_head_stride: int = 0) -> tuple[Tensor, Tensor]:
    """`qk_norm_rope`; with kv = (v, cache, slots), k and v also written to the cache as `write_kv` would; offset:
    the (1 + w) norm (`offset_qk_norm_rope_write_kv`). Heads are q_weight.shape[-1] wide, RoPE rotates the first
    cos.shape[-1] of each (`partial_rope`); q's heads lie q_head_stride apart (0: side by side)."""
    T, D, R = q.shape[0], q_weight.shape[-1], cos.shape[-1]
    QS = q_head_stride or D
    Hq, Hkv = q.shape[-1] // QS, k.shape[-1] // D
    if not use_triton(q):
        norm = offset_rms_norm_reference if offset else rms_norm_rows
        q = norm(q.reshape(T, Hq, QS)[..., :D], q_weight, eps)
        k = norm(k.reshape(T, Hkv, D), k_weight, eps)
        q, k = partial_rope(q, cos, sin).to(q.dtype), partial_rope(k, cos, sin).to(k.dtype)
        if kv is not None:
            v, cache, slots = kv
            write_kv(k, v.reshape(T, Hkv, D), cache, slots)
        return q, k
    q, k = unit_stride(q), unit_stride(k)
    q_out, k_out = q.new_empty(T, Hq, D), k.new_empty(T, Hkv, D)
    if kv is None:  # unused pointers: any tensor
        v, kc, vc, slots = q, q, q, q
    else:
        v, cache, slots = kv
        v, kc, vc = unit_stride(v), cache[0], cache[1]
    if T:
        chip = chip_for(q)
        split = T <= tuned("block.split_qk_tokens", chip)  # q and k heads in separate programs
        _qk_norm_rope_kernel[(T, 2 if split else 1)](
            q, k, q_weight.contiguous(), k_weight.contiguous(), cos.contiguous(), sin.contiguous(), q_out, k_out,
            q.stride(0), k.stride(0), v, v.stride(0), kc, vc, slots, eps, HQ=Hq, HKV=Hkv,
            HQ_P=triton.next_power_of_2(Hq), HKV_P=triton.next_power_of_2(Hkv), D=D, R=R, Q_HS=QS,
            WRITE_KV=kv is not None, SPLIT=split, OFFSET=offset, num_warps=tuned("block.qk_warps", chip),
            enable_fp_fusion=False, **pdl_launch(q))
    return q_out, k_out


def _qk_shapes(q: Tensor, k: Tensor, q_weight: Tensor, q_head_stride: int = 0) -> tuple[Tensor, Tensor]:
    """The q/k ops' outputs, empty (their fake implementations)."""
    T, D = q.shape[0], q_weight.shape[-1]
    return q.new_empty(T, q.shape[-1] // (q_head_stride or D), D), k.new_empty(T, k.shape[-1] // D, D)


@custom_op("monorl::qk_norm_rope", mutates_args=())
def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """q [T, Hq * D], k [T, Hkv * D] (heads side by side; e.g. column slices of a fused q/k/v GEMM's output) ->
    (q [T, Hq, D], k [T, Hkv, D]): per-head RMSNorm with q_weight / k_weight [D] (in q's dtype), then rotate-half
    RoPE with cos / sin [T, D]."""
    return _qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)


@custom_op("monorl::qk_norm_rope_write_kv", mutates_args=("cache",))
def qk_norm_rope_write_kv(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
                          sin: Tensor, eps: float, cache: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """`qk_norm_rope`, and the returned k with v [T, Hkv * D] written to the KV cache `cache` [2, ..., Hkv, D] at
    `slots` [T] in the same pass (the generator's prefill and decode: one kernel instead of three)."""
    return _qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, (v, cache, slots))


@custom_op("monorl::offset_qk_norm_rope_write_kv", mutates_args=("cache",))
def offset_qk_norm_rope_write_kv(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
                                 sin: Tensor, eps: float, cache: Tensor, slots: Tensor,
                                 q_head_stride: int = 0) -> tuple[Tensor, Tensor]:
    """`qk_norm_rope_write_kv` with the (1 + w) q/k norm (`monorl.ops.offset_rmsnorm`), forward only (the
    generator's copies: Gemma 3's `monorl.model.gemma3_fused`, Qwen3.5's `monorl.model.qwen3_5.GatedAttention`).
    Heads are q_weight.shape[-1] wide; RoPE rotates the first cos.shape[-1] dims of each (`partial_rope`); q's
    heads lie q_head_stride apart (0: side by side; Qwen3.5: 2 * head_dim, each query beside its output gate,
    read out of the q/k/v GEMM's output in place)."""
    return _qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, (v, cache, slots), True, q_head_stride)


@qk_norm_rope_write_kv.register_fake
def _(q, k, v, q_weight, k_weight, cos, sin, eps, cache, slots):
    return _qk_shapes(q, k, q_weight)


@offset_qk_norm_rope_write_kv.register_fake
def _(q, k, v, q_weight, k_weight, cos, sin, eps, cache, slots, q_head_stride=0):
    return _qk_shapes(q, k, q_weight, q_head_stride)


@qk_norm_rope.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps):
    return _qk_shapes(q, k, q_weight)


def _qk_norm_rope_setup(ctx, inputs, output) -> None:
    q, k, q_weight, k_weight, cos, sin, eps = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
    ctx.eps = eps


def _qk_norm_rope_backward(ctx, grad_q: Tensor, grad_k: Tensor):
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    gq, gqw = rms_norm_backward(q, q_weight, grad_q, ctx.eps, rope=(cos, sin))
    gk, gkw = rms_norm_backward(k, k_weight, grad_k, ctx.eps, rope=(cos, sin))
    return gq, gk, gqw, gkw, None, None, None


qk_norm_rope.register_autograd(_qk_norm_rope_backward, setup_context=_qk_norm_rope_setup)


@custom_op("monorl::silu_mul", mutates_args=())
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SiLU(gate) * up, both [T, N] (e.g. column slices of a fused gate/up GEMM's output)."""
    if not use_triton(gate):
        return F.silu(gate) * up
    return _act_mul(_silu_mul_kernel, gate, up)


def _act_mul(kernel, gate: Tensor, up: Tensor) -> Tensor:
    """One launch of an act(gate) * up kernel (`_silu_mul_kernel`, `_gelu_tanh_mul_kernel`): a program a token and
    column block."""
    gate, up = unit_stride(gate), unit_stride(up)
    T, N = gate.shape
    out = gate.new_empty(T, N)
    if T:
        chip = chip_for(gate)
        block = tuned("block.silu_block", chip)
        kernel[(T, triton.cdiv(N, block))](gate, up, out, N, gate.stride(0), up.stride(0), BLOCK=block,
                                           num_warps=tuned("block.silu_warps", chip), enable_fp_fusion=False,
                                           **pdl_launch(gate))
    return out


@silu_mul.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


def _silu_mul_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


@custom_op("monorl::silu_mul_backward", mutates_args=())
def _silu_mul_backward_op(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    if not use_triton(grad):
        g, x = grad.float(), gate.float()
        s = torch.sigmoid(x)
        return (g * up.float() * s * (1 + x * (1 - s))).to(gate.dtype), (g * x * s).to(up.dtype)
    grad, gate, up = grad.contiguous(), unit_stride(gate), unit_stride(up)
    T, N = gate.shape
    d_gate, d_up = gate.new_empty(T, N), up.new_empty(T, N)
    if T:
        chip = chip_for(grad)
        block = tuned("block.silu_block", chip)
        _silu_mul_backward_kernel[(T, triton.cdiv(N, block))](grad, gate, up, d_gate, d_up, N, gate.stride(0),
                                                               up.stride(0), BLOCK=block,
                                                               num_warps=tuned("block.silu_warps", chip))
    return d_gate, d_up


@_silu_mul_backward_op.register_fake
def _(grad, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _silu_mul_backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
    gate, up = ctx.saved_tensors
    return _silu_mul_backward_op(grad, gate, up)


silu_mul.register_autograd(_silu_mul_backward, setup_context=_silu_mul_setup)


@custom_op("monorl::gelu_tanh_mul", mutates_args=())
def gelu_tanh_mul(gate: Tensor, up: Tensor) -> Tensor:
    """GELU(gate, tanh approximation) * up, both [T, N] (column slices of a fused gate/up GEMM's output): Gemma 3's
    GeGLU, forward only (the generator's copy, `monorl.model.gemma3_fused`)."""
    if not use_triton(gate):
        return F.gelu(gate, approximate="tanh") * up
    return _act_mul(_gelu_tanh_mul_kernel, gate, up)


@gelu_tanh_mul.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)
