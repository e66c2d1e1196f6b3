"""Qwen3.5's decoder layer seams on fused Triton kernels, for the generator's CUDA copy (`monorl.model.fused_kernels.
use_fused_norms_`; forward only, not batch-invariant: that mode converts the copy back, `monorl.model.batch_invariant`).

Eager, a layer's decode step runs around its mixer and MLP: the pre-norm, the residual add, the post-attention norm,
the gate/up GEMM, SiLU and the product apart, the down GEMM, the second residual add. Here the first residual add and
the post-attention norm are one kernel (`offset_rmsnorm.offset_residual_norm`), SiLU(gate) * up one
(`block_kernels.silu_mul`), and the MLP's residual add runs in the next layer's first kernel: a converted layer
returns the pair (h, m) meaning h + m, still pending; the next layer (or the final norm) adds it and norms the sum with
its own weight in one `offset_residual_norm`. Three launches fewer a layer (72 a decode step of the 0.8B's 24 layers).
Each kernel rounds where the eager ops round.

Off (`ENABLED`) until its GPU tests pass (tests/test_qwen3_5_fused_gpu.py, the hybrid generator's bf16 cases in
tests/test_qwen3_5_gpu.py): written and tested under Triton's interpreter on 2026-12-08, when no GPU was lent.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from monorl.model.attention import AttentionContext
from monorl.model.layers import FusedOffsetRMSNorm
from monorl.model.mlp import MLP
from monorl.model.qwen3_5 import Qwen3_5Block
from monorl.ops.block_kernels import silu_mul
from monorl.ops.offset_rmsnorm import offset_residual_norm

ENABLED = False

Pending = tuple[Tensor, Tensor]  # (h, m): h + m, the add not yet done


class FusedQwen3_5MLP(MLP):
    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split([self.intermediate_size, self.intermediate_size], dim=-1)
        return self.down_proj(silu_mul(gate, up))


class FusedQwen3_5Block(Qwen3_5Block):
    def forward(self, x: Tensor | Pending, cos: Tensor, sin: Tensor, ctx: AttentionContext,
                cache: Any = None) -> Pending:
        eps = self.input_layernorm.eps
        if isinstance(x, tuple):  # the layer before's MLP output, its residual add pending
            x, normed = offset_residual_norm(x[0], x[1], self.input_layernorm.weight, eps)
        else:
            normed = self.input_layernorm(x)
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        h, n = offset_residual_norm(x, mixer(normed, cos, sin, ctx, cache), self.post_attention_layernorm.weight, eps)
        return h, self.mlp(n)


class FusedQwen3_5FinalNorm(FusedOffsetRMSNorm):
    """The model's final norm, taking the last converted layer's pending pair (`takes_pending`)."""

    takes_pending = True

    def forward(self, x: Tensor | Pending) -> Tensor:
        if isinstance(x, tuple):
            return offset_residual_norm(x[0], x[1], self.weight, self.eps)[1]
        return super().forward(x)


FUSED_QWEN3_5 = {Qwen3_5Block: FusedQwen3_5Block, MLP: FusedQwen3_5MLP}
# the batch-invariant mode's conversion takes a converted copy back to the plain classes first
PLAIN_QWEN3_5 = {v: k for k, v in FUSED_QWEN3_5.items()}


def use_fused_qwen3_5_(model: Any) -> bool:
    """Convert a generator copy's Qwen3.5 layers in place where `ENABLED` and every layer is a Qwen3.5 layer with
    fused projections; returns whether it did. Norms first (`use_fused_norms_`): the layers' norms must be converted.
    A layer's dense MLP takes the fused SiLU product; a sparse layer's MoE block stays as it is."""
    layers = model.model.layers
    if not ENABLED or not layers or not all(type(m) is Qwen3_5Block for m in layers):
        return False
    if not all(isinstance(m.input_layernorm, FusedOffsetRMSNorm) and (type(m.mlp) is not MLP or m.mlp.fused)
               for m in layers):
        return False
    for m in layers:
        m.__class__ = FusedQwen3_5Block
        if type(m.mlp) is MLP:
            m.mlp.__class__ = FusedQwen3_5MLP
    model.model.norm.__class__ = FusedQwen3_5FinalNorm
    return True
