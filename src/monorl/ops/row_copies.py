"""The gradient of rows copied into several places: out[u] = sum of x[copies[u, j]] over j, in fp32, in order j =
0, 1, ... (deterministic), where an index past x's last row stands for a copy that is not there. The trainer's shared
prompts (`monorl.model.attention.SharedPrompts`) sum each prompt token's key and value gradients over its copies with
it. On CUDA one Triton program per row reads only the copies that exist; elsewhere the same sums through a gather.
"""

from __future__ import annotations

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
