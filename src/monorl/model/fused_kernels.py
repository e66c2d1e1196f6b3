"""The generator's copy on CUDA, converted to the fused Triton block kernels (`monorl.ops.block_kernels`), so that
its decode step replayed from a CUDA graph is fast without `torch.compile` (whose cold compile a short run does
not pay back; issue #18's "CUDA graphs alone are fast").

The conversion gives each block's pieces a subclass whose forward calls the fused kernels (`module.__class__ =
...`, as `monorl.model.batch_invariant` does): parameters, names and weight sync are untouched, and a model not
converted is untouched. Per layer the decode step then runs: RMSNorm, the q/k/v GEMM, q/k norm + RoPE, the KV
write and attention, o_proj, residual add + RMSNorm, the gate/up GEMM, SiLU * up, down_proj, the residual add.

Only a copy with fused projections (`Qwen3ForCausalLM(fused=True)`, the generator's) converts: its q/k/v and
gate/up outputs are the layouts the kernels read. The trainer's model never converts, and a batch-invariant run's
generator (unfused) never does: its bitwise guarantee is for the invariant kernels on both sides.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from monorl.model.attention import AttentionContext
from monorl.model.qwen3 import MLP, Attention, Qwen3ForCausalLM, TransformerBlock
from monorl.ops import block_kernels, rmsnorm_invariant


class FusedKernelsAttention(Attention):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k = block_kernels.qk_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps,
                                          self.num_heads, self.num_kv_heads)
        v = qkv[:, self.sizes[0] + self.sizes[1]:].view(T, self.num_kv_heads, self.head_dim)
        return self.o_proj(ctx.attend(q, k, v, cache).flatten(1))


class FusedKernelsMLP(MLP):
    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(block_kernels.silu_mul(self.gate_up_proj(x)))


class FusedKernelsTransformerBlock(TransformerBlock):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any = None) -> Tensor:
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        a = self.self_attn(rmsnorm_invariant.rms_norm(x, ln1.weight, ln1.eps), cos, sin, ctx, cache)
        h, n = block_kernels.add_rms_norm(x, a, ln2.weight, ln2.eps)
        return h + self.mlp(n)


_CONVERTED: dict[type[nn.Module], type[nn.Module]] = {
    Attention: FusedKernelsAttention, MLP: FusedKernelsMLP, TransformerBlock: FusedKernelsTransformerBlock}
FUSED_KERNEL_CLASSES = tuple(_CONVERTED.values())


def use_fused_kernels_(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """Convert a fused-projection copy in place (see the module docstring); idempotent. Returns it."""
    head_dim = model.config.head_dim
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"use_fused_kernels_: the q/k kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    for m in model.modules():
        if isinstance(m, Attention | MLP) and not m.fused:
            raise ValueError("use_fused_kernels_: the model has unfused projections; build it with fused=True")
        if type(m) in _CONVERTED:
            m.__class__ = _CONVERTED[type(m)]
        elif isinstance(m, Attention | MLP | TransformerBlock) and not isinstance(m, FUSED_KERNEL_CLASSES):
            raise TypeError(f"use_fused_kernels_: no fused-kernel form of {type(m).__name__}")
    return model


def uses_fused_kernels(model: nn.Module) -> bool:
    return any(isinstance(m, FUSED_KERNEL_CLASSES) for m in model.modules())
