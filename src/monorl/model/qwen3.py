"""The one Qwen3 dense model definition, used by both the trainer and the generator.

Inputs are always flat: `input_ids [T]`, `positions [T]` and an `AttentionContext` that says how
the T tokens are laid out (packed sequences, a prefill, or one token per live decode sequence).
Parameter names equal HF transformers' `Qwen3ForCausalLM`, so checkpoints map one to one (the generator's
inference copy alone is built with fused projections: `PACKED_MODULES`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from monorl.compile import mark_dynamic
from monorl.model import logprobs
from monorl.model.attention import AttentionContext
from monorl.model.config import ModelConfig
from monorl.ops import custom_op, decode_gemm
from monorl.ops.rope import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, scale in the input dtype: the same rounding as HF's Qwen3RMSNorm.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Linear):
    """The model's projections: nn.Linear (`monorl.model.batch_invariant` converts exactly this class)."""

    def reset_parameters(self) -> None:
        # The model is built on meta and filled by init_weights or a checkpoint: nn.init's draw on a meta tensor
        # has nothing to do, and would import torch._dynamo (~3 s of a GPU run's startup, measured on an H200)
        if not self.weight.is_meta:
            super().reset_parameters()


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its init draw when built on meta (see `Linear.reset_parameters`)."""
    weight = torch.empty(num, dim)
    return nn.Embedding(num, dim, _weight=weight) if weight.is_meta else nn.Embedding(num, dim)


@custom_op("monorl::rope_cos_sin", mutates_args=())
def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [T, head_dim] for the given positions (computed in fp32, cast like HF does). A custom op, so these
    are eager's values under `torch.compile` too (Inductor's pow, divide and cos may round differently): a
    whole-model compiled trainer and an uncompiled generator then rotate by the same bits (batch-invariant mode)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@rope_cos_sin.register_fake
def _(positions, head_dim, theta, dtype):
    shape = (positions.shape[0], head_dim)
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


# The generator's copy is built fused: q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (one GEMM
# each). The trainer's copy and checkpoints keep HF's separate projections. This table says which HF projection
# is which row block of a fused one, in row order; `monorl.rl.weight_sync` copies through it.
PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.fused = fused
        self.sizes = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        if fused:
            self.qkv_proj = Linear(cfg.hidden_size, sum(self.sizes), bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, self.sizes[0], bias=False)
            self.k_proj = Linear(cfg.hidden_size, self.sizes[1], bias=False)
            self.v_proj = Linear(cfg.hidden_size, self.sizes[2], bias=False)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
        T = x.shape[0]
        if self.fused:  # column slices of one GEMM's output (v stays a strided view)
            q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # under autocast the fp32 norm weights promote q/k to fp32; attention runs in the projections' dtype
        q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)
        o = ctx.attend(q, k, v, cache)
        return self.o_proj(o.flatten(1))  # no Python int crosses the graph break around attend


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.fused, self.intermediate_size = fused, cfg.intermediate_size
        if fused:
            self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        else:
            self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
            self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).split([self.intermediate_size, self.intermediate_size], dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """One decoder layer; the unit of regional compile (the same code serves every layer)."""

    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, fused)
        self.mlp = MLP(cfg, fused)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(cfg, fused) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 dense. `forward` returns final hidden states [T, hidden]; `compute_logits` applies the
    LM head, so callers can chunk it (the trainer never materialises a whole pack's logits).

    fused: q/k/v and gate/up as one projection each (`PACKED_MODULES`), for an inference copy whose weights
    come from an unfused model through `monorl.rl.weight_sync`; unfused (the default), names equal HF's."""

    # recompute each block in backward instead of keeping its activations (set by the trainer's memory plan)
    activation_checkpointing: bool = False

    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg, fused)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext,
                kv_cache: Sequence[Any] | None = None, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """input_ids, positions: [T]. kv_cache: one entry per layer (or None), handed to `ctx.attend`. rope: the
        positions' `rope_cos_sin` in the activations' dtype, where the caller has them (the generator's decode
        step gathers them from tables of every position: `monorl.ops.decode_state`)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope if rope is not None else rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta,
                                                              x.dtype)
        mark_dynamic(x, cos, sin, dims=(0,))  # token counts vary (packs, prefills, decode buckets)
        checkpointed = self.activation_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            cache = None if kv_cache is None else kv_cache[i]
            if checkpointed:  # keeps only x; no RNG inside, so no RNG save/restore (CUDA-graph capturable)
                x = checkpoint(layer, x, cos, sin, ctx, cache, use_reentrant=False, preserve_rng_state=False)
            else:
                x = layer(x, cos, sin, ctx, cache)
        if isinstance(x, tuple) and not getattr(self.model.norm, "takes_pending", False):
            h, m = x  # a fused-kernels block's pair, its residual add pending; m a product, or its split-K parts
            x = h + m if m.dim() == h.dim() else h + decode_gemm.sum_parts(m, h.dtype)  # (`monorl.ops.decode_gemm`)
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor, weight: Tensor | None = None) -> Tensor:
        """Logits of `hidden` by the LM head; `weight`: that head's weight already in the compute dtype (the
        chunked trainer head casts it once for all its chunks)."""
        return F.linear(hidden, self.lm_head_weight if weight is None else weight)

    # log p(token) of logits [N, V] at temperature -> [N] fp32: the one function the trainer and the sampler
    # call (through the model, so a converted model's is the batch-invariant one)
    token_logprobs = staticmethod(logprobs.token_logprobs)

    @torch.no_grad()
    def logits_for(self, sequences: Sequence[Sequence[int]], backend: str = "auto") -> list[Tensor]:
        """Logits [len_i, vocab] for each of a batch of token sequences of unequal length, computed in
        one packed forward (no padding)."""
        from monorl.model.attention import VarlenContext, resolve_backend

        dev, dtype = self.lm_head_weight.device, self.lm_head_weight.dtype
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=dev)
        ctx = VarlenContext.from_lengths([len(s) for s in sequences], dev, resolve_backend(backend, dev, dtype))
        logits = self.compute_logits(self(ids, ctx.positions, ctx))
        return list(logits.split([len(s) for s in sequences]))

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> Qwen3ForCausalLM:
        """Random init (normal(0, std) matrices, unit norms), deterministic for a seed and device type.
        Drawn on the parameters' device: 0.6B normal samples on a CPU take seconds of startup."""
        gens: dict[torch.device, torch.Generator] = {}
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if p.device not in gens:
                gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.copy_(torch.randn(p.shape, generator=gens[p.device], dtype=torch.float32, device=p.device) * std)
        return self


def materialize_(module: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> nn.Module:
    """`module.to_empty(device=device)` (then its floating tensors in `dtype`, where given), in place, allocated with
    `torch.empty`: `to_empty`'s `empty_like` of a meta tensor runs torch's Python reference, whose first call imports
    sympy (~0.6 s of a run's startup)."""
    def empty(t: Tensor) -> Tensor:
        return torch.empty(t.shape, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype,
                           device=device)

    return module._apply(empty)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = 0, fused: bool = False) -> Qwen3ForCausalLM:
    """A randomly initialised model (seed) or, with seed=None, an uninitialised one (`torch.empty`).
    fused: with fused projections (see `Qwen3ForCausalLM`)."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, fused)
    materialize_(model, device, dtype)
    if seed is not None:
        model.init_weights(seed)
    return model
