"""Batch-invariant token log-probs: log_softmax(logits / temperature) at the chosen token, with one fixed
reduction order over the vocabulary per row (Triton on CUDA, a tree sum on CPU). Backward is ordinary math, on
CUDA one pass over the logits that takes each row's log-sum-exp from the forward's output (one-hot and softmax
materialised in fp32 were ~18 ms of a Qwen3-0.6B trainer step).

On CUDA a row's vocabulary is cut into `logprob.segments` (ops/tunables.py) segments whose length depends on V alone: a
program per (row, segment) finds the segment's max and its sum of exp(z - max) (its lanes in a fixed order), and a
second kernel merges a row's segments in order. The order is a function of V only, never of the row count, and the
trainer and the generator run the same two kernels. One program per row walking all of V took ~40 us at the decode
step's 40 rows (40 programs on 132 SMs); the segments give the GPU 8x the programs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from monorl.ops import HAS_TRITON, custom_op, pdl_launch, unit_stride, use_triton
from monorl.ops.tree_sum import tree_sum
from monorl.ops.tunables import chip_for, tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit
    def _logprob_segment_kernel(x_ptr, part_ptr, V, stride_x, temperature, seg_len, BLOCK_V: tl.constexpr,
                                PDL: tl.constexpr = False):
        """Program (row, segment): the segment's max of z = logits / T and its sum of exp(z - max) at part_ptr
        [rows, segments, 2]. An empty segment (past V) stores -inf and 0."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        row = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        base = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK_V)
        lo = seg * seg_len
        hi = tl.minimum(V, lo + seg_len)
        m_vec = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
        for s in range(lo, hi, BLOCK_V):
            z = tl.load(base + s + offs, mask=s + offs < hi, other=float("-inf")).to(tl.float32) / temperature
            m_vec = tl.maximum(m_vec, z)
        m = tl.max(m_vec, axis=0)
        s_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
        for s in range(lo, hi, BLOCK_V):  # vocab blocks in order, one lane per offset: a fixed sum order
            z = tl.load(base + s + offs, mask=s + offs < hi, other=float("-inf")).to(tl.float32) / temperature
            s_vec += tl.exp(z - m)
        out = part_ptr + (row * tl.num_programs(1) + seg) * 2
        tl.store(out, m)
        tl.store(out + 1, tl.sum(s_vec, axis=0))

    @triton.jit
    def _logprob_combine_kernel(x_ptr, t_ptr, part_ptr, o_ptr, stride_x, temperature, SEGMENTS: tl.constexpr,
                                PDL: tl.constexpr = False):
        """Program row: its segments' states merged in order, and log_softmax at its token."""
        if PDL:
            pdl_start()
        row = tl.program_id(0).to(tl.int64)
        seg = tl.arange(0, SEGMENTS)
        m_seg = tl.load(part_ptr + (row * SEGMENTS + seg) * 2)
        s_seg = tl.load(part_ptr + (row * SEGMENTS + seg) * 2 + 1)
        m = tl.max(m_seg, axis=0)
        total = tl.sum(tl.where(m_seg > float("-inf"), s_seg * tl.exp(m_seg - m), 0.0), axis=0)
        tok = tl.load(t_ptr + row)
        zt = tl.load(x_ptr + row * stride_x + tok).to(tl.float32) / temperature
        tl.store(o_ptr + row, zt - m - tl.log(total))

    @triton.jit
    def _logprob_backward_kernel(x_ptr, t_ptr, lp_ptr, g_ptr, gx_ptr, V, stride_x, temperature,
                                 BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        m = offs < V
        base = x_ptr + row * stride_x
        tok = tl.load(t_ptr + row)
        lse = tl.load(base + tok).to(tl.float32) / temperature - tl.load(lp_ptr + row)  # z_tok - log-prob
        coef = tl.load(g_ptr + row) / temperature
        p = tl.exp(tl.load(base + offs, mask=m, other=0.0).to(tl.float32) / temperature - lse)
        gx = coef * ((offs == tok).to(tl.float32) - p)
        tl.store(gx_ptr + row * V + offs, gx.to(gx_ptr.dtype.element_ty), mask=m)


@custom_op("monorl::bi_token_logprobs", mutates_args=())
def bi_token_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature)[row, tokens[row]] in fp32 -> [N]."""
    N, V = logits.shape
    if use_triton(logits):
        logits, tokens = logits.contiguous(), tokens.contiguous().long()
        out = torch.empty(N, dtype=torch.float32, device=logits.device)
        if N:
            # vocabulary segments a row's sums are cut into, each a whole number of blocks: V alone decides the order
            chip = chip_for(logits)
            segments, block = tuned("logprob.segments", chip), tuned("logprob.block", chip)
            seg_len = triton.cdiv(triton.cdiv(V, segments), block) * block
            part = torch.empty(N, segments, 2, dtype=torch.float32, device=logits.device)
            _logprob_segment_kernel[(N, segments)](logits, part, V, logits.stride(0), float(temperature), seg_len,
                                                   BLOCK_V=block, num_warps=tuned("logprob.warps", chip),
                                                   **pdl_launch(logits))
            _logprob_combine_kernel[(N,)](logits, tokens, part, out, logits.stride(0), float(temperature),
                                          SEGMENTS=segments, num_warps=tuned("logprob.combine_warps", chip),
                                          **pdl_launch(logits))
        return out
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    m = z.max(-1, keepdim=True).values  # max is exact in any order
    lse = torch.log(tree_sum(torch.exp(z - m)))
    return z.gather(-1, tokens[:, None].long())[:, 0] - m[:, 0] - lse


@bi_token_logprobs.register_fake
def _(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def _lp_setup(ctx, inputs, output) -> None:
    logits, tokens, temperature = inputs
    ctx.save_for_backward(logits, tokens, output)
    ctx.temperature = temperature


@custom_op("monorl::token_logprobs_backward", mutates_args=())
def _lp_backward_op(logits: Tensor, tokens: Tensor, logprobs: Tensor, grad: Tensor, temperature: float) -> Tensor:
    """The gradient of the logits: grad[row] * (onehot(tokens[row]) - softmax(logits[row] / T)) / T."""
    if not use_triton(logits):
        p = torch.softmax(logits.float() / temperature, dim=-1)
        onehot = F.one_hot(tokens.long(), logits.shape[-1]).to(p.dtype)
        return (grad[:, None] * (onehot - p) / temperature).to(logits.dtype)
    N, V = logits.shape
    logits = unit_stride(logits)
    out = torch.empty(N, V, dtype=logits.dtype, device=logits.device)
    if N:
        chip = chip_for(logits)
        block = tuned("logprob.backward_block", chip)
        _logprob_backward_kernel[(N, triton.cdiv(V, block))](
            logits, tokens.contiguous().long(), logprobs.contiguous(), grad.float().contiguous(), out, V,
            logits.stride(0), float(temperature), BLOCK_V=block, num_warps=tuned("logprob.backward_warps", chip))
    return out


@_lp_backward_op.register_fake
def _(logits, tokens, logprobs, grad, temperature):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _lp_backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
    logits, tokens, logprobs = ctx.saved_tensors
    return _lp_backward_op(logits, tokens, logprobs, grad, ctx.temperature), None, None


bi_token_logprobs.register_autograd(_lp_backward, setup_context=_lp_setup)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    return bi_token_logprobs(logits, tokens, float(temperature))
