"""Gemma 3's decoder layer on fused Triton kernels, for the generator's CUDA copy (`monorl.model.fused_kernels.
use_fused_norms_`; forward only, not batch-invariant: that mode converts the copy back, `monorl.model.batch_invariant`).

Eager, a Gemma 3 layer's decode step ran ~39 kernels: four (1 + w) norms, the residual adds, RoPE as ~10 elementwise
kernels for q and k, the KV write's two index copies, GELU and the product apart, the window layers' table mapping.
A 270M decode step at 16k x 64 rows (H100, 2026-12-07) spent 1.7 of its 3.3 ms outside attention and the GEMMs' bytes.
Here a layer runs: the q/k/v GEMM; q/k (1 + w) norm + RoPE + the KV write (`block_kernels.
offset_qk_norm_rope_write_kv`); attention; o_proj; the post-attention norm, residual add and pre-MLP norm in one
kernel (`offset_rmsnorm.offset_add_norm`); the gate/up GEMM; GELU(gate) * up (`block_kernels.gelu_tanh_mul`);
down_proj. The MLP's post-norm and add run in the next layer's first kernel: a converted layer returns the triple
(h, m, w) meaning h + (1 + w)-norm(m), still pending; the next layer (or the final norm) adds it and norms the sum
with its own weight in one `offset_add_norm`. Each kernel rounds where the eager ops round.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from monorl.model.attention import AttentionContext
from monorl.model.gemma3 import Gemma3Attention, Gemma3Block, Gemma3MLP
from monorl.model.layers import FusedOffsetRMSNorm
from monorl.ops.block_kernels import gelu_tanh_mul, offset_qk_norm_rope_write_kv
from monorl.ops.offset_rmsnorm import offset_add_norm

Pending = tuple[Tensor, Tensor, Tensor]  # (h, m, w): h + (1 + w)-norm(m), the add not yet done


class FusedGemma3Attention(Gemma3Attention):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
        view, kv = ctx, cache
        if hasattr(cache, "window_context"):  # a recycled window layer: its own blocks (`generate.window_cache`)
            view, kv = cache.window_context(ctx), cache.kv
        slots = getattr(view, "slot_mapping", None)
        if kv is None or slots is None:  # no KV cache to write (a plain forward) or a turn's window copy
            return super().forward(x, cos, sin, ctx, cache)
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        eps = self.q_norm.eps
        q, k = offset_qk_norm_rope_write_kv(q, k, v, self.q_norm.weight, self.k_norm.weight, cos, sin, eps, kv, slots)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        o = view.attend(q, k, v.view(T, self.num_kv_heads, self.head_dim), kv, True, self.window)
        return self.o_proj(o.flatten(1))


class FusedGemma3MLP(Gemma3MLP):
    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split([self.intermediate_size, self.intermediate_size], dim=-1)
        return self.down_proj(gelu_tanh_mul(gate, up))


class FusedGemma3Block(Gemma3Block):
    def forward(self, x: Tensor | Pending, cos: Tensor, sin: Tensor, ctx: AttentionContext,
                cache: Any = None) -> Pending:
        eps = self.input_layernorm.eps
        if isinstance(x, tuple):  # the layer before's MLP output, its post-norm and add pending
            x, normed = offset_add_norm(x[0], x[1], x[2], self.input_layernorm.weight, eps)
        else:
            normed = self.input_layernorm(x)
        a = self.self_attn(normed, cos, sin, ctx, cache)
        h, n = offset_add_norm(x, a, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight, eps)
        return h, self.mlp(n), self.post_feedforward_layernorm.weight


class FusedGemma3FinalNorm(FusedOffsetRMSNorm):
    """The model's final norm, taking the last converted layer's pending triple (`takes_pending`)."""

    takes_pending = True

    def forward(self, x: Tensor | Pending) -> Tensor:
        if isinstance(x, tuple):
            return offset_add_norm(x[0], x[1], x[2], self.weight, self.eps)[1]
        return super().forward(x)


FUSED_GEMMA3 = {Gemma3Attention: FusedGemma3Attention, Gemma3MLP: FusedGemma3MLP, Gemma3Block: FusedGemma3Block}
# the batch-invariant mode's conversion takes a converted copy back to the plain classes first
PLAIN_GEMMA3 = {v: k for k, v in FUSED_GEMMA3.items()}


def use_fused_gemma3_(model: Any) -> bool:
    """Convert a generator copy's Gemma 3 layers in place where it has fused projections (its q/k/v and gate/up
    each one GEMM) and every layer is a Gemma 3 layer; returns whether it did. Norms first (`use_fused_norms_`)."""
    layers = model.model.layers
    if not layers or not all(type(m) is Gemma3Block and m.self_attn.fused and m.mlp.fused for m in layers):
        return False
    for m in model.modules():
        if type(m) in FUSED_GEMMA3:
            m.__class__ = FUSED_GEMMA3[type(m)]
    model.model.norm.__class__ = FusedGemma3FinalNorm
    return True
