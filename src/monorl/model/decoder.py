"""The one decoder model definition, used by both the trainer and the generator, for every family in
`monorl.model.families` (Qwen3, Llama, Qwen2, Qwen3-MoE): the config says which pieces a family has (a q/k norm,
q/k/v and o biases, Llama 3 RoPE scaling, a tied head, mixture-of-experts MLPs in its sparse layers:
`monorl.model.moe`).

Inputs are always flat: `input_ids [T]`, `positions [T]` and an `AttentionContext` that says how
the T tokens are laid out (packed sequences, a prefill, or one token per live decode sequence).
Parameter names equal HF transformers' `*ForCausalLM` of the family, so checkpoints map one to one (the
generator's inference copy alone is built with fused projections: `monorl.distributed.weight_sync.PACKED_MODULES`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from monorl.compile import mark_dynamic
from monorl.model import logprobs
from monorl.model.attention import AttentionContext
from monorl.model.config import Llama3RopeScaling, ModelConfig
from monorl.model.layers import Linear, RMSNorm, embedding
from monorl.model.moe import SparseMoeBlock
from monorl.ops import custom_op
from monorl.ops.rope import apply_rope


@custom_op("monorl::rope_cos_sin", mutates_args=())
def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 llama3: list[float] | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin [T, head_dim] for the given positions (computed in fp32, cast like HF does); llama3: Llama 3's
    frequency scaling (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings). A custom op,
    so these are eager's values under `torch.compile` too (Inductor's pow, divide and cos may round differently):
    a whole-model compiled trainer and an uncompiled generator then rotate by the same bits (batch-invariant
    mode). `model_rope` passes a config's parameters."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    if llama3 is not None:
        inv_freq = _llama3_inv_freq(inv_freq, *llama3)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@rope_cos_sin.register_fake
def _(positions, head_dim, theta, dtype, llama3=None):
    shape = (positions.shape[0], head_dim)
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


def _llama3_inv_freq(inv_freq: Tensor, factor: float, low: float, high: float, original: float) -> Tensor:
    """HF's `_compute_llama3_parameters`, in its operation order (so the same fp32 values): long wavelengths
    divided by factor, short ones kept, the band between blended."""
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def model_rope(cfg: ModelConfig, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`rope_cos_sin` with the config's RoPE parameters."""
    s: Llama3RopeScaling | None = cfg.rope_scaling
    llama3 = None if s is None else [s.factor, s.low_freq_factor, s.high_freq_factor,
                                     float(s.original_max_position_embeddings)]
    return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype, llama3)


@custom_op("monorl::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """`apply_rope` of q [T, Hq, D] and k [T, Hkv, D], in their dtype, as one op opaque to `torch.compile`: the
    fused-kernels block of a family without a q/k norm (`monorl.model.fused_kernels`) rotates with it, so that a
    compiled trainer rounds RoPE's products and sum as the eager generator does (Inductor would fuse them into
    one rounding; the q/k norm families' kernel does the same for its RoPE)."""
    return apply_rope(q, cos, sin).to(q.dtype), apply_rope(k, cos, sin).to(k.dtype)


@rope.register_fake
def _(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _rope_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[2], inputs[3])
    ctx.dtypes = inputs[0].dtype, inputs[1].dtype


def _rope_backward(ctx, grad_q: Tensor, grad_k: Tensor) -> tuple[Tensor, Tensor, None, None]:
    # the rotation's transpose is the rotation by -angle (cos / sin repeat each half: rotate-half RoPE)
    cos, sin = ctx.saved_tensors
    return (apply_rope(grad_q, cos, -sin).to(ctx.dtypes[0]), apply_rope(grad_k, cos, -sin).to(ctx.dtypes[1]),
            None, None)


rope.register_autograd(_rope_backward, setup_context=_rope_setup)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
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
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
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
    """One decoder layer; the unit of regional compile (the same code serves every layer). sparse: its MLP is a
    mixture of experts (`monorl.model.moe.SparseMoeBlock`, a sparse layer of a Qwen3-MoE config)."""

    def __init__(self, cfg: ModelConfig, fused: bool = False, sparse: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, fused)
        if sparse:
            self.mlp: nn.Module = SparseMoeBlock(cfg)
        else:
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
        self.layers = nn.ModuleList(TransformerBlock(cfg, fused, cfg.sparse_layer(i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """The decoder of every family (see the module docstring). `forward` returns final hidden states [T, hidden];
    `compute_logits` applies the LM head, so callers can chunk it (the trainer never materialises a whole pack's
    logits).

    fused: q/k/v and gate/up as one projection each (`monorl.distributed.weight_sync.PACKED_MODULES`), for an
    inference copy whose weights come from an unfused model through `monorl.distributed.weight_sync`; unfused (the
    default), names equal HF's."""

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
        cos, sin = rope if rope is not None else model_rope(self.config, positions, x.dtype)
        mark_dynamic(x, cos, sin, dims=(0,))  # token counts vary (packs, prefills, decode buckets)
        checkpointed = self.activation_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            cache = None if kv_cache is None else kv_cache[i]
            if checkpointed:  # keeps only x; no RNG inside, so no RNG save/restore (CUDA-graph capturable)
                x = checkpoint(layer, x, cos, sin, ctx, cache, use_reentrant=False, preserve_rng_state=False)
            else:
                x = layer(x, cos, sin, ctx, cache)
        return self.model.norm(x)  # a fused-kernels model's norm takes the last block's pending (h, m) pair itself

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
    def init_weights(self, seed: int = 0, std: float = 0.02) -> DecoderForCausalLM:
        """Random init (normal(0, std) matrices and biases, unit norms), deterministic for a seed and device type.
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
                seed: int | None = 0, fused: bool = False) -> DecoderForCausalLM:
    """A randomly initialised model (seed) or, with seed=None, an uninitialised one (`torch.empty`).
    fused: with fused projections (see `DecoderForCausalLM`)."""
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, fused)
    materialize_(model, device, dtype)
    if seed is not None:
        model.init_weights(seed)
    return model
