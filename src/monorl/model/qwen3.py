"""The one Qwen3 dense model definition, used by both the trainer and the generator.

Inputs are always flat: `input_ids [T]`, `positions [T]` and an `AttentionContext` that says how
the T tokens are laid out (packed sequences, a prefill, or one token per live decode sequence).
Parameter names equal HF transformers' `Qwen3ForCausalLM`, so checkpoints map one to one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from monorl.model.attention import AttentionContext
from monorl.model.config import ModelConfig
from monorl.ops import batch_invariant as bi


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if bi.is_enabled():  # batch-invariant mode: fixed per-row reduction order, weight in x's dtype
            return bi.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32, scale in the input dtype: the same rounding as HF's Qwen3RMSNorm.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters) that switches to the batch-invariant matmul when the mode is on."""

    def forward(self, x: Tensor) -> Tensor:
        if bi.is_enabled():
            return bi.linear(x, self.weight)
        return super().forward(x)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [T, head_dim] for the given positions (computed in fp32, cast like HF does)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos/sin: [T, D]. Non-interleaved (rotate-half) RoPE as in HF."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class FusableProjections(nn.Module):
    """Base of `Attention` and `MLP`: bias-free Linear projections of one input (`_fusable`, in row order)
    whose weights may share one matrix, `fused_weight` [sum of their out_features, in_features].

    `fused_weight` is a non-persistent buffer, None until `fuse_()` (see `fuse_projections_`): never in
    `named_parameters()` or `state_dict()`. Once fused, the projections' Parameters are row-slice views of
    it, so they keep their HF names and shapes and an in-place copy into them (`Generator.load_weights_`,
    `load_state_dict`, an optimizer step) writes the fused matrix; forward then runs one GEMM and splits it.
    Anything that re-allocates the Parameters (`.to()`, `load_state_dict(assign=True)`, deepcopy, pickle)
    re-fuses, so the two never drift apart. The unfused per-projection path runs when no fused matrix is
    set, in batch-invariant mode (its bitwise guarantee must not depend on GEMM shapes), and when autograd
    is recording for trainable weights (the fused buffer would carry no gradient to them).
    """

    _fusable: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fused_weight", None, persistent=False)
        self.register_load_state_dict_post_hook(_refuse_after_load)

    def _projections(self) -> list[Linear]:
        return [getattr(self, n) for n in self._fusable]

    def is_fused(self) -> bool:
        """True when `fused_weight` is set and every projection's weight is its row-slice view."""
        f = self.fused_weight
        if f is None:
            return False
        row = 0
        for lin in self._projections():
            w, view = lin.weight, f[row:row + lin.weight.shape[0]]
            if (w.device, w.dtype, w.shape, w.stride(), w.data_ptr()) != (
                    view.device, view.dtype, view.shape, view.stride(), view.data_ptr()):
                return False
            row += w.shape[0]
        return row == f.shape[0]

    @torch.no_grad()
    def fuse_(self) -> None:
        """Allocate the fused matrix, copy the projections' weights into its rows and re-point each
        Parameter's `.data` at its row slice. No-op when already fused."""
        if self.is_fused():
            return
        lins = self._projections()
        fused = torch.cat([lin.weight.detach() for lin in lins])  # one new contiguous allocation
        row = 0
        for lin in lins:
            n = lin.weight.shape[0]
            lin.weight.data = fused[row:row + n]
            row += n
        self.fused_weight = fused

    def _project(self, x: Tensor) -> list[Tensor]:
        """Each projection of x: one GEMM over the fused matrix (split by columns), or one per projection."""
        lins = self._projections()
        f = self.fused_weight
        if f is None or bi.is_enabled() or (torch.is_grad_enabled() and lins[0].weight.requires_grad):
            return [lin(x) for lin in lins]
        return list(F.linear(x, f).split([lin.out_features for lin in lins], dim=-1))

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half(), to_empty(): converted views become copies
        super()._apply(fn, recurse)
        if self.fused_weight is not None:
            self.fuse_()  # a no-op when fn returned the same tensors (e.g. .to() the current device)
        return self

    def __setstate__(self, state: dict[str, Any]) -> None:  # deepcopy / pickle clone Parameters apart
        super().__setstate__(state)
        if self.fused_weight is not None:
            self.fuse_()


def _refuse_after_load(module: FusableProjections, incompatible_keys: Any) -> None:
    """load_state_dict post-hook (a module-level function, so modules stay picklable): after
    `assign=True` the Parameters are new tensors; copy-loading kept the views and this is a no-op."""
    if module.fused_weight is not None:
        module.fuse_()


class Attention(FusableProjections):
    _fusable = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
        T = x.shape[0]
        q, k, v = self._project(x)  # fused: column slices of one GEMM output (v stays a strided view)
        q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # under autocast the fp32 norm weights promote q/k to fp32; attention runs in the projections' dtype
        q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)
        o = ctx.attend(q, k, v, cache)
        return self.o_proj(o.flatten(1))  # no Python int crosses the graph break around attend


class MLP(FusableProjections):
    _fusable = ("gate_proj", "up_proj")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self._project(x)
        return self.down_proj(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """One decoder layer; the unit of regional compile (the same code serves every layer)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 dense. `forward` returns final hidden states [T, hidden]; `compute_logits` applies the
    LM head, so callers can chunk it (the trainer never materialises a whole pack's logits)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext,
                kv_cache: Sequence[Any] | None = None) -> Tensor:
        """input_ids, positions: [T]. kv_cache: one entry per layer (or None), handed to `ctx.attend`."""
        x = self.model.embed_tokens(input_ids)
        if bi.is_enabled() and bi.compute_dtype() is not None:  # the trainer's fp32 masters -> generator's dtype
            x = x.to(bi.compute_dtype())
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for t in (x, cos, sin):  # token counts vary (packs, prefills, decode buckets): one dynamic compile
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, ctx, None if kv_cache is None else kv_cache[i])
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        if bi.is_enabled():
            return bi.linear(hidden, self.lm_head_weight)
        return F.linear(hidden, self.lm_head_weight)

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


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = 0) -> Qwen3ForCausalLM:
    """A randomly initialised model (seed) or, with seed=None, an uninitialised one (`torch.empty`)."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if seed is not None:
        model.init_weights(seed)
    return model


def fuse_projections_(model: nn.Module) -> nn.Module:
    """Fuse q/k/v and gate/up of every layer in place (see `FusableProjections`): 4 projection GEMMs per
    layer instead of 7. Parameter names, shapes and values are unchanged; idempotent.
    For inference copies (the generator's): the fused matrices are new allocations, so call this before
    capturing CUDA graphs, never after."""
    for m in model.modules():
        if isinstance(m, FusableProjections):
            m.fuse_()
    return model
