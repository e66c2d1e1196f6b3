"""GPT-OSS's decoder layer (transformers' GptOssDecoderLayer), registered in `monorl.model.decoder.FAMILY_BLOCKS`
for model_type "gpt_oss".

Attention: GQA with q/k/v/o biases, a learned sink logit per head (`sinks` [Hq]: added to each head's softmax
denominator, `AttentionContext.attend(..., sinks=)`), on "sliding_attention" layers a window of `sliding_window`
keys; RoPE is YaRN's (`monorl.model.yarn`) on every layer. Pre-norm RMSNorms as Llama's.

The MLP is GPT-OSS's own mixture of experts (`GptOssMoeBlock`), not `monorl.model.moe.SparseMoeBlock`: its router
has a bias and takes the top-k *logits* then a softmax over those k (Qwen3-MoE: softmax over all, then top-k), its
experts have biases, a clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), gate clamped above at `limit`, up
on both sides) and HF's layouts: `gate_up_proj` [E, hidden, 2I] with gate and up *interleaved* along the last dim
([..., ::2] / [..., 1::2]), `down_proj` [E, I, hidden] (x @ W, not F.linear's W^T), so checkpoints map one to one.
It reuses SparseMoeBlock's token sort and per-token combine (`monorl.model.moe`), and runs the same paths: one
`torch._grouped_mm` launch per projection over the tokens grouped by expert (bf16 on sm90+: gradients, or many
tokens), one product per expert on its sorted slice (the same elsewhere), a gather of each slot's expert weights (a
decode step's few tokens, CUDA-graph capturable), and in batch-invariant mode every expert over all rows for a
decode step (its `linear` the invariant GEMM, so a token's outputs do not depend on its batch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from monorl.model.attention import AttentionContext
from monorl.model.blocks import Attention
from monorl.model.config import ModelConfig
from monorl.model.layers import Linear, RMSNorm
from monorl.model.moe import (
    LinearFn,
    _capturing,
    _combine,
    _sort_by_expert,
    compute_dtype,
    expert_path,
    grouped_rows,
    softmax_invariant,
)
from monorl.ops import matmul_invariant
from monorl.speedups.private_apis import grouped_mm


class GptOssAttention(Attention):
    """GQA attention with learned sinks per head (a logit each head's softmax adds to its denominator)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, fused: bool = False) -> None:
        super().__init__(cfg, fused, layer_index)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        o = ctx.attend(q, k, v, cache, window=self.window, sinks=self.sinks)
        return self.o_proj(o.flatten(1))


class GptOssExperts(nn.Module):
    """E experts in HF's GptOssExperts layout (see the module docstring)."""

    # tensor-parallel generation (as `monorl.model.moe.Experts.TP_SHARDS`): gate and up interleave along the last
    # dim, so a contiguous 1/N of it holds whole (gate, up) pairs; the down bias is added once, by rank 0 ("once")
    TP_SHARDS = {"gate_up_proj": (2, ""), "gate_up_proj_bias": (1, ""), "down_proj": (1, ""),
                 "down_proj_bias": (0, "once")}

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))


def clamped_swiglu(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """HF's GptOssExperts._apply_gate: interleaved gate / up, each clamped, (up + 1) * gate * sigmoid(alpha gate)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssMoeBlock(nn.Module):
    """GPT-OSS's MLP: `router` (a biased Linear [E, hidden]) and `experts` (see the module docstring)."""

    router_name = "router"  # (`monorl.model.moe.moe_blocks`: router taps, the load-balancing loss)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.router = Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """(weights [T, k], experts [T, k]): HF's GptOssTopKRouter, the top-k logits then a softmax over them."""
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), experts

    def forward(self, x: Tensor) -> Tensor:
        weights, experts = self.route(self.router(x))
        return self.run_experts(x.to(compute_dtype(x)), weights, experts)

    def expert(self, x: Tensor, e: int, linear: LinearFn = F.linear) -> Tensor:
        """Expert e's output on the rows x [N, hidden]."""
        p, dt = self.experts, x.dtype
        h = linear(x, p.gate_up_proj[e].t()) + p.gate_up_proj_bias[e].to(dt)
        return linear(clamped_swiglu(h, self.alpha, self.limit), p.down_proj[e].t()) + p.down_proj_bias[e].to(dt)

    def experts_loop(self, x: Tensor, weights: Tensor, experts: Tensor, linear: LinearFn = F.linear) -> Tensor:
        """One product per expert on its contiguous slice of the sorted (token, slot) pairs (reads the counts)."""
        k = experts.shape[1]
        order, inverse, counts = _sort_by_expert(experts, self.num_experts)
        xs = x[order // k]
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                outs.append(self.expert(xs[start:start + n], e, linear))
                start += n
        return _combine(torch.cat(outs)[inverse], weights)

    def experts_gathered(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Each (token, slot)'s expert weights gathered, one bmm per projection (a decode step: no host read)."""
        T, k = experts.shape
        p, flat, dt = self.experts, experts.reshape(-1), x.dtype
        xr = x[:, None].expand(T, k, x.shape[-1]).reshape(T * k, 1, -1)
        h = torch.bmm(xr, p.gate_up_proj.index_select(0, flat).to(dt)).squeeze(1)
        h = h + p.gate_up_proj_bias.index_select(0, flat).to(dt)
        y = torch.bmm(clamped_swiglu(h, self.alpha, self.limit).unsqueeze(1), p.down_proj.index_select(0, flat).to(dt))
        return _combine(y.squeeze(1) + p.down_proj_bias.index_select(0, flat).to(dt), weights)

    def experts_grouped(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """The experts by `torch._grouped_mm` over the tokens grouped by expert (`monorl.model.moe.grouped_rows`),
        each row's biases its group's: no host read, so a trainer step with gradients captures in a CUDA graph."""
        p, dt = self.experts, x.dtype
        xs, offs, row = grouped_rows(x, experts, self.num_experts)
        group = torch.searchsorted(offs.long(), torch.arange(xs.shape[0], device=x.device), right=True)
        group = group.clamp_max(self.num_experts - 1)  # the tail rows past the last end: padding, outputs unread
        h = grouped_mm(xs, p.gate_up_proj.to(dt), offs) + p.gate_up_proj_bias.to(dt)[group]
        y = grouped_mm(clamped_swiglu(h, self.alpha, self.limit), p.down_proj.to(dt), offs)
        return _combine((y + p.down_proj_bias.to(dt)[group])[row], weights)

    def run_experts(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        path = expert_path(x, experts, self.experts.gate_up_proj, self.experts.down_proj)
        if path == "gathered":
            return self.experts_gathered(x, weights, experts)
        if path == "grouped":
            return self.experts_grouped(x, weights, experts)
        return self.experts_loop(x, weights, experts)


class BatchInvariantGptOssMoeBlock(GptOssMoeBlock):
    """The block in batch-invariant mode (`monorl.model.batch_invariant`): fixed-order softmax over the top-k, every
    product on the invariant GEMM; a decode step runs every expert over all rows (fixed shapes), a pack the loop."""

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return softmax_invariant(top).to(top.dtype), experts

    def run_experts(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        linear = matmul_invariant.linear
        if not torch.is_grad_enabled() and (experts.numel() <= self.num_experts or _capturing(x)):
            every = torch.stack([self.expert(x, e, linear) for e in range(self.num_experts)])
            rows = torch.arange(x.shape[0], device=x.device).repeat_interleave(experts.shape[1])
            return _combine(every[experts.reshape(-1), rows], weights)
        return self.experts_loop(x, weights, experts, linear)


class GptOssBlock(nn.Module):
    """One GPT-OSS decoder layer: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_index: int, fused: bool = False) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer_index, fused)
        self.mlp = GptOssMoeBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, cache)
        return x + self.mlp(self.post_attention_layernorm(x))
