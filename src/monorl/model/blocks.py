"""The decoder layer of the Llama-shaped families (Qwen3, Llama, Qwen2, Qwen3-MoE): GQA attention, a SiLU-gated MLP
(or a sparse mixture of them), pre-norm residuals. A family whose layer differs registers its own block class in
`monorl.model.decoder.FAMILY_BLOCKS` (built from these pieces where it can)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from monorl.model.attention import AttentionContext
from monorl.model.config import ModelConfig
from monorl.model.layers import Linear, RMSNorm
from monorl.model.mlp import MLP
from monorl.model.moe import SparseMoeBlock
from monorl.ops.rope import apply_rope


class Attention(nn.Module):
    """GQA attention: q/k/v projections, a per-head q/k norm where the family has one, RoPE, the context's attention
    (`window` keys on a "sliding_attention" layer), o. A family's attention that adds to it (Gemma 3's q scale,
    GPT-OSS's sinks) subclasses it: `norm_class`, and `qkv` for the rotated q, k, v."""

    norm_class: type[nn.Module] = RMSNorm  # the per-head q/k norm's class (Qwen3's; Gemma 3's is (1 + w))

    def __init__(self, cfg: ModelConfig, fused: bool = False, layer_index: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.fused = fused
        self.sizes = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        bias = cfg.qkv_bias
        if fused:  # (biases fused the same way: q, k, v row blocks of one vector)
            self.qkv_proj = Linear(cfg.hidden_size, sum(self.sizes), bias=bias)
        else:
            self.q_proj = Linear(cfg.hidden_size, self.sizes[0], bias=bias)
            self.k_proj = Linear(cfg.hidden_size, self.sizes[1], bias=bias)
            self.v_proj = Linear(cfg.hidden_size, self.sizes[2], bias=bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        # a per-head norm of q and k (Qwen3); None for the families without one
        self.q_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = cfg.sliding_window if cfg.layer_type(layer_index) == "sliding_attention" else 0

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D]: projected, normed where the family norms them, q and k rotated."""
        T = x.shape[0]
        if self.fused:  # column slices of one GEMM's output (v stays a strided view)
            q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k = q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # under autocast the fp32 norm weights promote q/k to fp32; attention runs in the projections' dtype
        return apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        o = ctx.attend(q, k, v, cache, window=self.window)
        return self.o_proj(o.flatten(1))  # no Python int crosses the graph break around attend


class TransformerBlock(nn.Module):
    """One decoder layer; the unit of regional compile (the same code serves every layer). sparse: its MLP is a
    mixture of experts (`monorl.model.moe.SparseMoeBlock`, a sparse layer of a Qwen3-MoE config)."""

    def __init__(self, cfg: ModelConfig, fused: bool = False, sparse: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, fused)
        if sparse:
            self.mlp: nn.Module = SparseMoeBlock(cfg, fused)
        else:
            self.mlp = MLP(cfg, fused)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


