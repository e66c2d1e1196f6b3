"""A generator's decode step of a Gated DeltaNet layer (`monorl.model.qwen3_5`) on CUDA: two Triton kernels that
read and write each sequence's conv and delta-rule states in place, in its cache row (`rows`), instead of ~75 ATen
ops and the state copied four times (gathered out of the cache, read and written by the rule, scattered back).

- `conv_step`: the causal depthwise conv's one new input per row -> SiLU(conv) [N, C], the row's conv state
  shifted by one (its oldest input out, this one in). Each product and sum is rounded to x's dtype in the order
  `monorl.ops.gated_delta.causal_conv` takes, so the output equals it (the trainer's); launched without FMA
  contraction (Triton fuses a multiply and an add by default, which drops the product's rounding: the likely cause
  of the 1-3 bf16 ulps the first H100 run saw in 4.8% of outputs).
- `rule_step`: per (row, value head, block of BV values): q, k, v from the conv output, q and k L2-normalised and q
  scaled by Dk ** -0.5, beta = sigmoid(b) (rounded to b's dtype, as the model's `b.sigmoid()`), the log decay
  g = -exp(A_log) * softplus(a + dt_bias) in fp32; then the gated delta rule's one step on the row's fp32 state
  [Dk, BV] (decay, delta, update, read out), written back where it was read. fla's fused_recurrent kernel's
  arithmetic (a program per value block, as vLLM's, which also takes state indices).

A program touches only its own row's (and value block's) state, so no two programs of a step race, except the
padded rows of a CUDA-graph batch, which all point at scratch row 0 (garbage there is never read for a live row).
Elsewhere (CPU, no Triton) the model runs the plain-PyTorch path. Tested against that path under Triton's
interpreter (tests/test_gated_delta_decode.py, fp32) and on an H100 (tests/test_qwen3_5_gpu.py: in bf16 against the
gathered reference, and the hybrid generator as exact as the trainer against a float64 forward, 2026-12-07), so
`ENABLED` is on by default.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, use_triton
from monorl.ops.tunables import chip_for, tuned

ENABLED = True  # the in-place kernels in a CUDA decode step (off: the plain gather-step-scatter path)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _conv_step_kernel(x_ptr, stride_x, state_ptr, stride_sr, stride_st, w_ptr, rows_ptr, out_ptr, stride_o, C,
                          KW: tl.constexpr, BC: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        m = c < C
        row = tl.load(rows_ptr + n).to(tl.int64)
        st = state_ptr + row * stride_sr + c
        x = tl.load(x_ptr + n * stride_x + c, mask=m, other=0)
        dt = x.dtype
        # tap i reads the input KW - 1 - i before: taps 0 .. KW - 2 are the state's slots, tap KW - 1 is x
        # the weight rounded to x's dtype first, as causal_conv's weight.to(x.dtype)
        w = tl.load(w_ptr + c * KW, mask=m, other=0).to(dt).to(tl.float32)
        acc = (tl.load(st, mask=m, other=0).to(dt).to(tl.float32) * w).to(dt)
        for i in tl.static_range(1, KW - 1):
            s = tl.load(st + i * stride_st, mask=m, other=0).to(dt).to(tl.float32)
            w = tl.load(w_ptr + c * KW + i, mask=m, other=0).to(dt).to(tl.float32)
            acc = (acc.to(tl.float32) + (s * w).to(dt).to(tl.float32)).to(dt)
        w = tl.load(w_ptr + c * KW + KW - 1, mask=m, other=0).to(dt).to(tl.float32)
        p = (x.to(tl.float32) * w).to(dt)
        a = (acc.to(tl.float32) + p.to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out_ptr + n * stride_o + c, (a / (1.0 + tl.exp(-a))).to(dt), mask=m)
        for i in tl.static_range(0, KW - 2):  # shift: slot i <- slot i + 1 (read before it is overwritten)
            tl.store(st + i * stride_st, tl.load(st + (i + 1) * stride_st, mask=m), mask=m)
        tl.store(st + (KW - 2) * stride_st, x.to(state_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rule_step_kernel(x_ptr, stride_x, a_ptr, stride_a, b_ptr, stride_b, a_log_ptr, dt_bias_ptr, state_ptr,
                          stride_sr, rows_ptr, o_ptr, scale, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                          DV: tl.constexpr, BV: tl.constexpr):
        NV: tl.constexpr = DV // BV
        pid = tl.program_id(0).to(tl.int64)
        i_v, i_nh = pid % NV, pid // NV
        n, hv = i_nh // HV, i_nh % HV
        h = hv // (HV // HK)
        row = tl.load(rows_ptr + n).to(tl.int64)
        ok = tl.arange(0, DK)
        ov = i_v * BV + tl.arange(0, BV)
        xr = x_ptr + n * stride_x
        q = tl.load(xr + h * DK + ok).to(tl.float32)
        k = tl.load(xr + HK * DK + h * DK + ok).to(tl.float32)
        v = tl.load(xr + 2 * HK * DK + hv * DV + ov).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q) + 1e-6)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k) + 1e-6))
        b = tl.load(b_ptr + n * stride_b + hv)
        beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
        z = tl.load(a_ptr + n * stride_a + hv).to(tl.float32) + tl.load(dt_bias_ptr + hv).to(tl.float32)
        softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z)))  # torch's threshold
        g = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus
        p_h = state_ptr + row * stride_sr + hv * DK * DV + ok[:, None] * DV + ov[None, :]
        s = tl.load(p_h) * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(o_ptr + (n * HV + hv) * DV + ov, tl.sum(s * q[:, None], 0).to(o_ptr.dtype.element_ty))
        tl.store(p_h, s)


def in_place_decode(x: Tensor) -> bool:
    """Whether a decode step on x's device runs these kernels (CUDA with Triton, once `ENABLED`)."""
    return ENABLED and use_triton(x)


def conv_step(x: Tensor, weight: Tensor, state: Tensor, rows: Tensor) -> Tensor:
    """x [N, C] (one new input per row, unit last stride), weight [C, K], state [R, K - 1, C] (one layer's rows, the
    conv state's layout) -> SiLU(conv) [N, C] in x's dtype; state[rows] shifted in place."""
    N, C = x.shape
    K = weight.shape[1]
    out = torch.empty(N, C, dtype=x.dtype, device=x.device)
    BC = 256
    _conv_step_kernel[(N, triton.cdiv(C, BC))](x, x.stride(0), state, state.stride(0), state.stride(1),
                                               weight.contiguous(), rows, out, out.stride(0), C, KW=K, BC=BC,
                                               enable_fp_fusion=False)
    return out


def rule_step(x: Tensor, a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor, state: Tensor, rows: Tensor,
              hk: int, dk: int) -> Tensor:
    """x [N, 2 * hk * dk + Hv * Dv] (the conv's output: q | k | v), a, b [N, Hv] (in_proj_a / in_proj_b's outputs),
    a_log, dt_bias [Hv], state [R, Hv, Dk, Dv] fp32 (one layer's rows, contiguous per row) -> o [N, Hv, Dv] in x's
    dtype; state[rows] advanced by one step in place."""
    N = x.shape[0]
    hv, dv = state.shape[1], state.shape[3]
    chip = chip_for(x)
    bv = math.gcd(tuned("gated_delta_decode.rule_bv", chip), dv)  # a power of two dividing Dv (tl.arange's)
    assert state.dtype == torch.float32 and state[0].is_contiguous()
    o = torch.empty(N, hv, dv, dtype=x.dtype, device=x.device)
    _rule_step_kernel[(N * hv * (dv // bv),)](x, x.stride(0), a, a.stride(0), b, b.stride(0), a_log, dt_bias, state,
                                              state.stride(0), rows, o, dk ** -0.5, HK=hk, HV=hv, DK=dk, DV=dv, BV=bv,
                                              num_warps=tuned("gated_delta_decode.rule_warps", chip),
                                              num_stages=tuned("gated_delta_decode.rule_stages", chip))
    return o
