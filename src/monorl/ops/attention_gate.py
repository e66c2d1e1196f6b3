"""Qwen3.5's attention output gate, o * sigmoid(gate), as one Triton kernel for the generator's CUDA copy
(`monorl.model.qwen3_5.GatedAttention`). The gate is read in place from the q/k/v GEMM's output, where each head's
gate sits beside its query; eager ran a reshape copy of it, the sigmoid and the product (three kernels a layer).
Forward only (the trainer keeps the eager ops, `gate_reference`); rounds as those do (the sigmoid rounded to the
dtype, then the product); row-local, so no result depends on the batch."""

from __future__ import annotations

import torch
from torch import Tensor

from monorl.ops import HAS_TRITON, custom_op, pdl_launch, unit_stride, use_triton
from monorl.ops.tunables import chip_for, tuned

# the generator copy's gated attention on these kernels (`kernels_serve`). Off until its GPU tests pass
# (tests/test_gated_attention_kernel_gpu.py, tests/test_qwen3_5_gpu.py's bf16 generator cases): written and tested
# under Triton's interpreter on 2026-12-08, when no GPU was lent; an unfinished draft of it failed the generator
# test on an H100 that day
ENABLED = False

if HAS_TRITON:
    import triton
    import triton.language as tl

    from monorl.ops import pdl_start

    @triton.jit
    def _sigmoid_gate_kernel(o_ptr, g_ptr, out_ptr, N, stride_gt, stride_gh, D: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr = False):
        """out[t, c] = o[t, c] * sigmoid(gate[t, c // D, c % D]) over a block of columns c of token t; the gate's
        heads stride_gh apart."""
        if PDL:  # wait for the kernel before (programmatic dependent launch)
            pdl_start()
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        g = tl.load(g_ptr + t * stride_gt + (offs // D) * stride_gh + offs % D, mask=m, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + t * N + offs, mask=m, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        s = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + t * N + offs, (o * s).to(dt), mask=m)


def gate_reference(o: Tensor, gate: Tensor) -> Tensor:
    """o [T, H, D] times sigmoid(gate) [T, H, D] (any strides), as [T, H * D]: the eager ops (the layer's plain
    path, and `sigmoid_gate_mul` off CUDA)."""
    return o.flatten(1) * torch.sigmoid(gate.reshape(o.shape[0], -1))


@custom_op("monorl::sigmoid_gate_mul", mutates_args=())
def sigmoid_gate_mul(o: Tensor, gate: Tensor) -> Tensor:
    """`gate_reference` in one launch on CUDA: a program a token and column block, the gate [T, H, D] read through
    its strides (a view of the q|gate columns of a fused projection's output: no copy)."""
    if not use_triton(o):
        return gate_reference(o, gate)
    o, gate = o.contiguous(), unit_stride(gate)
    T, H, D = gate.shape
    out = o.new_empty(T, H * D)
    if T:
        chip = chip_for(o)
        block, warps = tuned("block.silu_block", chip), tuned("block.silu_warps", chip)  # (elementwise kernels')
        _sigmoid_gate_kernel[(T, triton.cdiv(H * D, block))](o, gate, out, H * D, gate.stride(0), gate.stride(1),
                                                             D=D, BLOCK=block, num_warps=warps,
                                                             enable_fp_fusion=False, **pdl_launch(o))
    return out


@sigmoid_gate_mul.register_fake
def _(o, gate):
    return o.new_empty(o.shape[0], o.shape[1] * o.shape[2])


def kernels_serve(x: Tensor, head_dim: int, rotary_dim: int) -> bool:
    """Whether this kernel and the q/k one (`block_kernels.offset_qk_norm_rope_write_kv`) take a gated attention
    layer of these widths on x's device: CUDA with Triton; whole heads and half rotary widths are the q/k kernel's
    tiles, so both widths powers of two (head_dim >= 16, as `fused_kernels_supported` asks of the dense families)."""
    pow2 = all(n > 0 and not n & (n - 1) for n in (head_dim, rotary_dim))
    return ENABLED and use_triton(x) and pow2 and head_dim >= 16 and 2 <= rotary_dim <= head_dim
