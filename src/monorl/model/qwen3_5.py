"""Qwen3.5's decoder layer (`Qwen3_5ForCausalLM`, model_type qwen3_5_text; transformers' models/qwen3_5 is the
oracle, names equal its): a hybrid of Gated DeltaNet layers ("linear_attention") and gated full-attention layers,
each with a SiLU-gated MLP, every norm an RMSNorm scaling by (1 + w) in fp32.

- `GatedAttention`: q_proj gives each head's query and an output gate side by side ([q | gate] per head); q/k
  (1 + w) norms; RoPE on the first `rotary_dim` dims of each head (`ModelConfig.partial_rotary_factor`); the
  attention output times sigmoid(gate) before o_proj. Its cache is the paged KV of every full-attention layer.
- `GatedDeltaNet`: in_proj_qkv -> causal depthwise conv1d (+ SiLU) -> q, k, v; beta = sigmoid(in_proj_b), the
  log decay g = -exp(A_log) * softplus(in_proj_a + dt_bias); the gated delta rule (`monorl.ops.gated_delta`);
  a gated RMSNorm by in_proj_z; out_proj. Its cache (`monorl.generate.recurrent_state.RecurrentLayer`) holds a
  conv state and a delta-rule state per sequence, in rows the attention context's sequences are looked up in.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from monorl.model.attention import AttentionContext
from monorl.model.config import ModelConfig
from monorl.model.layers import FusedOffsetRMSNorm, Linear, OffsetRMSNorm
from monorl.model.mlp import MLP
from monorl.model.moe import SparseMoeBlock
from monorl.ops import gated_delta_invariant, gated_rmsnorm, rmsnorm_invariant
from monorl.ops import gated_delta_padded as padded
from monorl.ops.attention_gate import gate_reference, kernels_serve, sigmoid_gate_mul
from monorl.ops.block_kernels import offset_qk_norm_rope_write_kv
from monorl.ops.gated_delta import causal_conv, fla_bounds, fla_serves, gated_delta_rule, packed_causal_conv
from monorl.ops.gated_delta_decode import conv_step, in_place_decode, rule_step
from monorl.ops.gated_delta_invariant import invariant_decode, invariant_rule, pointwise
from monorl.ops.rope import partial_rope


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3_5RMSNormGated: w * norm(x) (cast back to x's dtype), times SiLU(gate) in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return gated_rmsnorm.gated_rms_norm_reference(x, gate, self.weight, self.eps)


class FusedGatedRMSNorm(GatedRMSNorm):
    """The generator's CUDA copy (`monorl.model.fused_kernels.use_fused_norms_`): one kernel a norm
    (`monorl.ops.gated_rmsnorm`), forward only."""

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return gated_rmsnorm.gated_rms_norm(x, gate, self.weight, self.eps)


class BatchInvariantGatedRMSNorm(GatedRMSNorm):
    """Batch-invariant mode (`monorl.model.batch_invariant`): the invariant norm, the weight in x's dtype."""

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        h = rmsnorm_invariant.bi_rms_norm(x, self.weight.to(x.dtype), self.eps)
        return (h * pointwise(F.silu, gate.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """q (with its output gate: 2 x the heads' width), k, v, o; fused (the generator's copy): q/k/v as one
    `qkv_proj` (`monorl.distributed.weight_sync.PACKED_MODULES`). That copy on CUDA, its norms converted
    (`use_fused_norms_`), writing a paged KV cache, runs the layer's elementwise work in two kernels: q/k norm +
    partial RoPE + the KV write (`block_kernels.offset_qk_norm_rope_write_kv`, each query read from beside its gate
    in the GEMM's output), and the output gate (`attention_gate.sigmoid_gate_mul`), where eager runs 21; while
    `attention_gate.ENABLED` (off until its GPU tests pass)."""

    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        self.sizes = (cfg.num_heads * cfg.head_dim * 2, kv, kv)
        self.fused = fused
        if fused:
            self.qkv_proj = Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.o_bias)
        else:
            self.q_proj = Linear(cfg.hidden_size, self.sizes[0], bias=cfg.o_bias)
            self.k_proj = Linear(cfg.hidden_size, self.sizes[1], bias=cfg.o_bias)
            self.v_proj = Linear(cfg.hidden_size, self.sizes[2], bias=cfg.o_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
        T, D = x.shape[0], self.head_dim
        if self.fused:  # column slices of one GEMM's output
            qg, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = qg.view(T, self.num_heads, 2 * D).chunk(2, dim=-1)  # views: each head's [query | gate]
        v = v.view(T, self.num_kv_heads, D)
        slots = getattr(ctx, "slot_mapping", None) if cache is not None else None
        if self._kernels_serve(qg, cache, slots):
            q, k = offset_qk_norm_rope_write_kv(qg, k, v, self.q_norm.weight, self.k_norm.weight, cos, sin,
                                                self.q_norm.eps, cache, slots, 2 * D)
            return self.o_proj(sigmoid_gate_mul(ctx.attend(q, k, v, cache, kv_written=True), gate))
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, self.num_kv_heads, D))
        q, k = partial_rope(q, cos, sin).to(v.dtype), partial_rope(k, cos, sin).to(v.dtype)
        o = ctx.attend(q.contiguous(), k.contiguous(), v, cache)
        return self.o_proj(gate_reference(o, gate))

    def _kernels_serve(self, qg: Tensor, cache: Any, slots: Tensor | None) -> bool:
        """The generator's CUDA copy (fused projections, its (1 + w) norms converted by `use_fused_norms_`; the
        batch-invariant mode converts them back, and keeps the eager path) writing a paged KV cache."""
        return (self.fused and isinstance(self.q_norm, FusedOffsetRMSNorm) and slots is not None
                and not hasattr(cache, "window_context") and kernels_serve(qg, self.head_dim, self.rotary_dim))


class _Conv(nn.Module):
    """The depthwise conv's weight [C, 1, K], under HF's name (`conv1d.weight`); `causal_conv` applies it."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))


class GatedDeltaNet(nn.Module):
    """The linear-attention layer: q/k/v (through the conv), z (the norm's gate), b (beta), a (the decay) projected
    from x; fused (the generator's copy): the four as one `in_proj` (`weight_sync.PACKED_MODULES`)."""

    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        conv_dim = 2 * self.key_dim + self.value_dim
        self.sizes = (conv_dim, self.value_dim, self.hv, self.hv)  # in_proj_qkv, _z, _b, _a
        self.fused = fused
        if fused:
            self.in_proj = Linear(cfg.hidden_size, sum(self.sizes), bias=False)
        else:
            self.in_proj_qkv = Linear(cfg.hidden_size, conv_dim, bias=False)
            self.in_proj_z = Linear(cfg.hidden_size, self.value_dim, bias=False)
            self.in_proj_b = Linear(cfg.hidden_size, self.hv, bias=False)
            self.in_proj_a = Linear(cfg.hidden_size, self.hv, bias=False)
        self.conv1d = _Conv(conv_dim, cfg.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
        T = x.shape[0]
        if self.fused:  # column slices of one GEMM's output
            mixed, z, b, a = self.in_proj(x).split(self.sizes, dim=-1)
        else:
            mixed, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        z = z.view(T, self.hv, self.dv)
        run = layout_of(ctx, cache)
        if run.one_token_each and run.from_state and not run.reference and in_place_decode(x):
            conv, ssm = cache.states()  # a decode step on CUDA: each row's states advanced where they are
            mixed = conv_step(mixed, self.conv1d.weight[:, 0], conv, run.rows)
            o = rule_step(mixed, a, b, self.A_log, self.dt_bias, ssm, run.rows, self.hk, self.dk)
            cache.stepped(run.rows, run.ends)
        else:
            o = self._mix(x, mixed, a, b, run, cache)
        o = self.norm(o.to(x.dtype).reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(o.view(T, self.value_dim))

    def _mix(self, x: Tensor, mixed: Tensor, a: Tensor, b: Tensor, run: _Layout, cache: Any) -> Tensor:
        """The conv and the rule over packed sequences (trainer, prefill, cached prefill, decode off CUDA) -> o."""
        shared = run.shared
        if shared is not None:  # each sequence whole (a shared prompt copied into every one), as attention sees it
            mixed, b, a = (shared.expand(t[:, None])[:, 0] for t in (mixed, b, a))
        weight = self.conv1d.weight[:, 0]
        if run.reference:  # batch-invariant mode: the parameters as the generator's copy holds them (x's dtype)
            g = -self.A_log.to(x.dtype).float().exp() * pointwise(F.softplus, a.float() + self.dt_bias.to(x.dtype))
            beta = pointwise(torch.sigmoid, b)
        else:
            g, beta = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()
        if run.rows is None and not run.reference and padded.serves(mixed, weight, g, beta):
            # the trainer's pack where fla serves: one padded sequence, no host read (a trainer CUDA graph holds it)
            o = padded.padded_conv_rule(mixed, weight, g, beta, run.padded(mixed.shape[0], weight.shape[1]),
                                        (self.key_dim, self.key_dim, self.value_dim),
                                        (self.hk, self.dk, self.hv, self.dv))
        else:
            o = self._varlen_mix(mixed, weight, g, beta, run, cache)
        return o if shared is None else shared.contract(o)

    def _varlen_mix(self, mixed: Tensor, weight: Tensor, g: Tensor, beta: Tensor, run: _Layout,
                    cache: Any) -> Tensor:
        """The conv and the rule on the packed sequences as they lie, each state read and written where kept."""
        conv_init, state_init = cache.read(run.rows) if run.from_state else (None, None)
        if run.rows is None and not run.reference:  # the trainer's pack, default mode: no state in or out
            mixed, conv_final = packed_causal_conv(mixed, weight, run.cu_seqlens, run.bounds()), None
        else:
            silu = functools.partial(pointwise, F.silu) if run.reference else F.silu
            mixed, conv_final = causal_conv(mixed, weight, run.cu_seqlens, conv_init, silu)
        n = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.view(n, self.hk, self.dk), k.view(n, self.hk, self.dk), v.view(n, self.hv, self.dv)
        if run.reference:
            o, state_final = _invariant_rule(run, cache, q, k, v, g, beta, state_init)
        else:
            o, state_final = gated_delta_rule(q, k, v, g, beta, run.cu_seqlens, state_init, run.one_token_each,
                                              bounds=None if run.one_token_each else run.bounds())
        if run.rows is not None:
            cache.write(run.rows, conv_final, state_final, run.ends)
        return o


def _invariant_rule(run: _Layout, cache: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    state: Tensor | None) -> tuple[Tensor, Tensor]:
    """Batch-invariant mode (`monorl.ops.gated_delta_invariant`): the trainer's packs chunked from each sequence's
    start; a generator's forward continues each sequence from its boundary state and kept chunk, and writes both."""
    if run.rows is None:
        return invariant_rule(q, k, v, g, beta, run.cu_seqlens)[:2]
    kept = cache.read_kept(run.rows) if run.from_state else None
    if run.one_token_each:
        o, state, kept = invariant_decode(q, k, v, g, beta, state, kept, run.ends - 1)
    else:
        cu = run.cu_seqlens.long()
        before = run.ends - (cu[1:] - cu[:-1])  # positions each state covered before this forward
        kept_len = (before % gated_delta_invariant.CHUNK).tolist() if kept is not None else None
        o, state, kept, _ = invariant_rule(q, k, v, g, beta, run.cu_seqlens, state, kept, kept_len)
    cache.write_kept(run.rows, kept)
    return o, state


class _Layout:
    """How a forward's tokens form sequences for a Gated DeltaNet layer (`layout_of`)."""

    def __init__(self, cu_seqlens: Tensor, rows: Tensor | None = None, ends: Tensor | None = None,
                 one_token_each: bool = False, shared: Any = None, reference: bool = False,
                 from_state: bool = True) -> None:
        self.cu_seqlens, self.rows, self.ends = cu_seqlens, rows, ends
        self.from_state = rows is not None and from_state
        self.one_token_each, self.shared, self.reference = one_token_each, shared, reference
        self._bounds: tuple[Tensor, Tensor] | None = None
        self._padded: padded.PaddedLayout | None = None

    def bounds(self) -> tuple[Tensor, Tensor] | None:
        """`fla_bounds` of the sequences, made by the first layer that asks (one device read a forward) where fla
        serves; None elsewhere (the references read cu_seqlens themselves)."""
        if self._bounds is None and fla_serves(self.cu_seqlens):
            self._bounds = fla_bounds(self.cu_seqlens)
        return self._bounds

    def padded(self, tokens: int, width: int) -> padded.PaddedLayout:
        """The trainer pack's padded layout (`gated_delta_padded`) of its `tokens` rows (the sequences whole, shared
        prompts copied, as the layers' inputs are here), made by the first layer that asks: device ops only."""
        if self._padded is None:
            self._padded = padded.padded_layout(self.cu_seqlens, tokens, width)
        return self._padded


def layout_of(ctx: Any, cache: Any) -> _Layout:
    """The sequences of `ctx` (the trainer's varlen pack, or the generator's prefill / cached prefill / decode) and,
    with a cache, each one's state row and how many positions its state covers after this forward. A prefill
    starts every sequence from zeros (its rows are written); a cached prefill and a decode continue each from its
    row. Batch-invariant contexts run the mode's rule (`_invariant_rule`: both sides the same order)."""
    backend = getattr(ctx, "backend", None) or getattr(getattr(ctx, "varlen", None), "backend", None)
    reference = backend == "invariant"
    memo = vars(ctx).get("_recurrent_layout")  # every layer of a forward has the same: made by the first layer
    if cache is None or getattr(ctx, "slot_mapping", None) is None:  # the trainer's pack: no state kept
        if memo is None or memo.cu_seqlens is not ctx.cu_seqlens:
            memo = vars(ctx)["_recurrent_layout"] = _Layout(ctx.cu_seqlens, shared=getattr(ctx, "shared", None),
                                                            reference=reference)
        return memo
    # the runner builds a context per forward
    if memo is None:
        memo = vars(ctx)["_recurrent_layout"] = _cached_layout(ctx, cache, reference)
    return memo


def _cached_layout(ctx: Any, cache: Any, reference: bool) -> _Layout:
    if hasattr(ctx, "varlen"):  # a prefill from position 0
        cu = ctx.varlen.cu_seqlens
        rows, ends = cache.rows(ctx.slot_mapping, cu), (cu[1:] - cu[:-1]).long()
        return _Layout(cu, rows, ends, reference=reference, from_state=False)
    if hasattr(ctx, "cu_seqlens_q"):  # a turn's new tokens over each sequence's kept state
        cu = ctx.cu_seqlens_q
        rows = cache.rows(ctx.slot_mapping, cu)
        return _Layout(cu, rows, ctx.positions[(cu[1:].long() - 1).clamp(min=0)] + 1, reference=reference)
    cu = getattr(ctx, "cu_seqlens", None)  # a decode (or the decode rows of a turn, one sequence's in order)
    one = cu is None
    if one:
        cu = torch.arange(ctx.seq_lens.shape[0] + 1, dtype=torch.int32, device=ctx.seq_lens.device)
    rows = cache.rows(ctx.slot_mapping, cu)
    return _Layout(cu, rows, ctx.seq_lens[(cu[1:].long() - 1).clamp(min=0)].long(), one_token_each=one,
                   reference=reference)


class Qwen3_5Block(nn.Module):
    """One Qwen3.5 decoder layer: its kind's token mixer (`linear_attn` or `self_attn`), then the MLP (Qwen3.5-MoE,
    qwen3_5_moe_text: a sparse layer's, `monorl.model.moe.SparseMoeBlock` with its shared expert)."""

    final_norm = OffsetRMSNorm  # the model's final norm (`monorl.model.decoder.Qwen3Model`)

    def __init__(self, cfg: ModelConfig, i: int, fused: bool = False) -> None:
        super().__init__()
        if cfg.layer_type(i) == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, fused)
        else:
            self.self_attn = GatedAttention(cfg, fused)
        self.mlp = SparseMoeBlock(cfg, fused) if cfg.sparse_layer(i) else MLP(cfg, fused)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any = None) -> Tensor:
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        x = x + mixer(self.input_layernorm(x), cos, sin, ctx, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


