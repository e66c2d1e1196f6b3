"""A model converted to the fused Triton block kernels (`monorl.ops.block_kernels`): each block's norms, RoPE and
SiLU in three kernels. The generator's CUDA copy converts, so that its decode step replayed from a CUDA graph is
fast without `torch.compile` (whose cold compile a short run does not pay back; issue #18's "CUDA graphs alone are
fast"). A batch-invariant run converts both its models (`monorl.model.batch_invariant`): the kernels are row-local
and have a backward, so trainer and generator share them.

The conversion gives each block's pieces a subclass whose forward calls the fused kernels (`module.__class__ =
...`, as `monorl.model.batch_invariant` does): parameters, names and weight sync are untouched, and a model not
converted is untouched. Its projections take a decode step's few rows to the Triton GEMM (`FusedKernelsLinear`).
Per layer the decode step then runs: RMSNorm, the q/k/v GEMM, q/k norm + RoPE with the KV write (a family
without a q/k norm: RoPE as one op, the attention context writes the KV cache), attention,
o_proj, residual add + RMSNorm, the gate/up GEMM with SiLU * up as its epilogue (`matmul_invariant.mm_silu_mul`, a
fused copy's decode rows on Hopper; elsewhere the GEMM, then `silu_mul`), down_proj; the residual add after it runs
in the next block's first norm (a converted block passes its output on as the pair (h, m), sum pending). At decode
rows o_proj and down_proj may hand that add their product as fp32 K parts (`project`, `monorl.ops.decode_gemm`).
A copy with fused projections (`DecoderForCausalLM(fused=True)`, the generator's) hands the kernels column slices of
one GEMM's output; an unfused model (the trainer's) its separate projections. Norm weights enter the kernels in the
activations' dtype (the trainer's fp32 masters as exactly the generator's bf16 copy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from monorl.model.attention import AttentionContext
from monorl.model.blocks import Attention, TransformerBlock
from monorl.model.decoder import DecoderForCausalLM
from monorl.model.gemma3_fused import use_fused_gemma3_
from monorl.model.layers import FusedOffsetRMSNorm, Linear, OffsetRMSNorm, RMSNorm
from monorl.model.mlp import MLP
from monorl.model.qwen3_5 import FusedGatedRMSNorm, GatedRMSNorm
from monorl.model.qwen3_5_fused import use_fused_qwen3_5_
from monorl.model.rope import rope
from monorl.ops import block_kernels, decode_gemm, matmul_invariant, matmul_invariant_split, rmsnorm_invariant


class FusedKernelsLinear(Linear):
    """A decode step's products (up to `matmul_invariant.GEMV_ROWS` rows, on Hopper) on the Triton GEMM with its
    decode tiling, which reads the weight faster than cuBLAS there; the rest (prefills, packs) stays on cuBLAS."""

    # where `matmul_invariant.faster_than_cublas(x)`, its product is `matmul_invariant.linear`'s (without a bias):
    # the fused MLP may then run the gate/up product and SiLU * up as one kernel (`mm_silu_mul`)
    decode_rows_on_triton = True

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None and matmul_invariant.faster_than_cublas(x):
            return matmul_invariant.linear(x, self.weight)
        return super().forward(x)


def project(proj: nn.Module, x: Tensor) -> Tensor:
    """proj(x) for a block's last projections (o_proj, down_proj), whose output only the next residual add + norm
    reads; at a decode step's rows where splitting K pays (`decode_gemm.split_k_fits`: Qwen3-0.6B's and 1.7B's
    products, up to 192 rows), its fp32 K parts [P, T, N] instead, which that add sums (`add_norm`). Only this
    class's projections; a batch-invariant copy's (`BatchInvariantLinear`, `invariant_parts`) hand over the invariant
    GEMM's own K parts where it would write them out anyway (`matmul_invariant_split.partials_fit`): the sum is then
    the one `bi_mm` rounds, so the trainer's product is the same."""
    # (a tensor-parallel copy's row-parallel projection is summed over ranks by its forward: never split there)
    if proj.bias is not None or torch.is_grad_enabled() or getattr(proj, "row_parallel", False):
        return proj(x)
    if type(proj) is FusedKernelsLinear and decode_gemm.split_k_fits(x, proj.weight):
        return decode_gemm.split_k_parts(x, proj.weight.to(x.dtype))
    if getattr(proj, "invariant_parts", False) and matmul_invariant_split.partials_fit(x, proj.weight):
        return matmul_invariant_split.invariant_partials(x, proj.weight.to(x.dtype))
    return proj(x)


def add_norm(x: Tensor, a: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`block_kernels.add_rms_norm` of x + a, where a is a product or its split-K parts (`project`)."""
    if a.dim() == x.dim():
        return block_kernels.add_rms_norm(x, a, weight, eps)
    return block_kernels.add_parts_rms_norm(x, a, weight, eps)


class FusedKernelsFinalNorm(RMSNorm):
    """The model's last norm on the Triton kernel (one launch where the eager ops ran ~8: fp32 cast, square, mean,
    rsqrt, products, casts). It takes the last block's output pair (h, m) itself (`takes_pending`), its add in the
    same launch (`add_norm`)."""

    takes_pending = True  # `DecoderForCausalLM.forward` hands it the last block's (h, m) as they are

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        if isinstance(x, tuple):
            return add_norm(x[0], x[1], self.weight.to(x[0].dtype), self.eps)[1]
        return rmsnorm_invariant.rms_norm(x, self.weight, self.eps)


class FusedKernelsAttention(Attention):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
        T = x.shape[0]
        if self.fused:  # column slices of one GEMM's output, read in place
            q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is None:  # a family without q/k norm (Llama, Qwen2): RoPE alone, one opaque op
            q, k = rope(q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
                        cos.to(q.dtype), sin.to(q.dtype))
            v = v.view(T, self.num_kv_heads, self.head_dim)
            return project(self.o_proj, ctx.attend(q, k, v, cache).flatten(1))
        qw, kw, eps = self.q_norm.weight.to(q.dtype), self.k_norm.weight.to(q.dtype), self.q_norm.eps
        slots = ctx.slot_mapping if cache is not None else None
        if slots is None:
            q, k = block_kernels.qk_norm_rope(q, k, qw, kw, cos, sin, eps)
        else:  # the generator: k and v go to the KV cache in the same pass
            q, k = block_kernels.qk_norm_rope_write_kv(q, k, v, qw, kw, cos, sin, eps, cache, slots)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        return project(self.o_proj, ctx.attend(q, k, v, cache, kv_written=slots is not None).flatten(1))


class FusedKernelsMLP(MLP):
    def forward(self, x: Tensor) -> Tensor:
        proj = self.gate_up_proj if self.fused else None
        if (getattr(proj, "decode_rows_on_triton", False) and proj.bias is None
                and matmul_invariant.silu_mul_fusable(x)):
            # a decode step: the gate/up GEMM with SiLU * up as its epilogue, bitwise the two kernels below
            return project(self.down_proj, matmul_invariant.mm_silu_mul(x, self.gate_up_proj.weight.to(x.dtype)))
        if self.fused:
            gate, up = self.gate_up_proj(x).split([self.intermediate_size, self.intermediate_size], dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return project(self.down_proj, block_kernels.silu_mul(gate, up))


class FusedKernelsTransformerBlock(TransformerBlock):
    def forward(self, x: Tensor | tuple[Tensor, Tensor], cos: Tensor, sin: Tensor, ctx: AttentionContext,
                cache: Any = None) -> tuple[Tensor, Tensor]:
        """x: the residual stream, or (h, m) with its last add h + m still pending (the block before's output; m
        may be split-K parts, see `project`); returns such a pair: the add runs in the next block's first norm
        (`DecoderForCausalLM.forward` does the last one), one kernel where it took two."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if isinstance(x, tuple):
            x, normed = add_norm(x[0], x[1], ln1.weight.to(x[0].dtype), ln1.eps)
        else:
            normed = rmsnorm_invariant.rms_norm(x, ln1.weight, ln1.eps)
        a = self.self_attn(normed, cos, sin, ctx, cache)
        h, n = add_norm(x, a, ln2.weight.to(x.dtype), ln2.eps)
        return h, self.mlp(n)


_CONVERTED: dict[type[nn.Module], type[nn.Module]] = {
    Linear: FusedKernelsLinear, Attention: FusedKernelsAttention, MLP: FusedKernelsMLP,
    TransformerBlock: FusedKernelsTransformerBlock}
FUSED_KERNEL_CLASSES = tuple(_CONVERTED.values())


def fused_kernels_supported(model: DecoderForCausalLM) -> bool:
    """The q/k kernel's shape limit: a power-of-two head_dim >= 16; and Llama-shaped blocks (a family's own block,
    `monorl.model.decoder.FAMILY_BLOCKS`, runs its plain forward)."""
    head_dim = model.config.head_dim
    return (head_dim >= 16 and not head_dim & (head_dim - 1)
            and all(isinstance(layer, TransformerBlock) for layer in model.model.layers))


def use_fused_kernels_(model: DecoderForCausalLM) -> DecoderForCausalLM:
    """Convert in place (see the module docstring); idempotent. Returns it."""
    if not fused_kernels_supported(model):
        raise ValueError(f"use_fused_kernels_: the q/k kernel needs a power-of-two head_dim >= 16, got "
                         f"{model.config.head_dim}")
    for m in model.modules():
        if type(m) in _CONVERTED:
            m.__class__ = _CONVERTED[type(m)]
        elif isinstance(m, Attention | MLP | TransformerBlock) and not isinstance(m, FUSED_KERNEL_CLASSES):
            raise TypeError(f"use_fused_kernels_: no fused-kernel form of {type(m).__name__}")
    if type(model.model.norm) is RMSNorm:  # the blocks' norms run inside their kernels; this one runs alone
        model.model.norm.__class__ = FusedKernelsFinalNorm
    elif not getattr(model.model.norm, "takes_pending", False):  # it must take the last block's pending pair
        raise TypeError(f"use_fused_kernels_: the final norm is a {type(model.model.norm).__name__}: convert to fused "
                        "kernels before any other conversion (batch invariance)")
    return model


def use_fused_norms_(model: DecoderForCausalLM) -> DecoderForCausalLM:
    """A generator copy whose family runs its own decoder layers (Gemma 3, Qwen3.5: `fused_kernels_supported` is
    False): its (1 + w) norms and Qwen3.5's gated norms one kernel each (`FusedOffsetRMSNorm`, `FusedGatedRMSNorm`),
    and Gemma 3's and Qwen3.5's layers on their fused kernels where the copy has fused projections
    (`monorl.model.gemma3_fused`, `monorl.model.qwen3_5_fused`); forward only. Returns it."""
    for m in model.modules():
        if type(m) is OffsetRMSNorm:
            m.__class__ = FusedOffsetRMSNorm
        elif type(m) is GatedRMSNorm:
            m.__class__ = FusedGatedRMSNorm
    use_fused_gemma3_(model)
    use_fused_qwen3_5_(model)
    return model


def uses_fused_kernels(model: nn.Module) -> bool:
    return any(isinstance(m, FUSED_KERNEL_CLASSES) for m in model.modules())
