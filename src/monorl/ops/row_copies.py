"""Rows gathered and copied, with backwards that stay cheap.

`take_rows`: x[index] for an index that names each row at most once (a shared-prompt pack's first copies, the
trainer's logit rows). Autograd's backward of x[index] is an accumulating index_put, CUDA's sort-based
`indexing_backward_kernel`: 3.3 ms a call on SmolLM2's packs, 31 calls (one per layer and the head) = 102 ms of a
150 ms trainer step (H100, benchmarks/profile_rl_step.py, #62). Here the gradient is an `index_add_` into zeros: the
same values, no sort; an index named twice still gets its gradients summed (in an order CUDA's atomics choose: the
callers' indices repeat only for padding rows, whose gradients are exactly zero).

`sum_row_copies`: the gradient of rows copied into several places: out[u] = sum of x[copies[u, j]] over j, in fp32,
in order j = 0, 1, ... (deterministic), where an index past x's last row stands for a copy that is not there. The
trainer's shared prompts (`monorl.model.attention.SharedPrompts`) sum each prompt token's key and value gradients
over its copies with it. On CUDA one Triton program per row reads only the copies that exist; elsewhere the same
sums through a gather.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, use_triton
from monorl.ops.tunables import chip_for, tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _sum_copies_kernel(x_ptr, copies_ptr, out_ptr, N, W: tl.constexpr, COLS: tl.constexpr,
                           BLOCK: tl.constexpr):
        u = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        cmask = offs < COLS
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(W):
            src = tl.load(copies_ptr + u * W + j)
            x = tl.load(x_ptr + src * COLS + offs, mask=cmask & (src < N), other=0.0)
            acc += x.to(tl.float32)
        tl.store(out_ptr + u * COLS + offs, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def sum_row_copies(x: Tensor, copies: Tensor) -> Tensor:
    """x [N, ...] (rows), copies int64 [T, W] (indices into x; N or more: none) -> [T, ...] in x's dtype."""
    N = x.shape[0]
    T, W = copies.shape
    if use_triton(x) and T:
        x = x.contiguous()
        cols = x[0].numel() if N else 0
        out = x.new_empty(T, *x.shape[1:])
        _sum_copies_kernel[(T,)](x, copies.contiguous(), out, N, W=W, COLS=cols,
                                 BLOCK=triton.next_power_of_2(max(cols, 16)),
                                 num_warps=tuned("row_copies.warps", chip_for(x)))
        return out
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded[copies.clamp(max=N)].sum(1, dtype=torch.float32).to(x.dtype)


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_add_(0, index, grad), None


def take_rows(x: Tensor, index: Tensor) -> Tensor:
    """x[index] along dim 0 for an int64 `index` whose repeated entries carry zero gradients (the module docstring)."""
    return _TakeRows.apply(x, index) if x.requires_grad else x.index_select(0, index)
