"""The one decoder model definition, used by both the trainer and the generator, for every family in
`monorl.model.families`: the config says which pieces a Llama-shaped family has (Qwen3, Llama, Qwen2, Qwen3-MoE: a
q/k norm, q/k/v and o biases, Llama 3 RoPE scaling, a tied head, mixture-of-experts MLPs in its sparse layers:
`monorl.model.moe`); a family whose layer differs (Gemma 3, Qwen3.5, GPT-OSS) has its own block (`FAMILY_BLOCKS`),
and a vision-language model (Qwen3-VL) its tower (`monorl.model.vision`), whose embeddings enter `forward`.

Inputs are always flat: `input_ids [T]`, `positions [T]` and an `AttentionContext` that says how
the T tokens are laid out (packed sequences, a prefill, or one token per live decode sequence).
Parameter names equal HF transformers' `*ForCausalLM` of the family, so checkpoints map one to one (the
generator's inference copy alone is built with fused projections: `monorl.distributed.weight_sync.PACKED_MODULES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from monorl.compile import mark_dynamic
from monorl.model import logprobs
from monorl.model.attention import AttentionContext
from monorl.model.blocks import TransformerBlock
from monorl.model.config import ModelConfig
from monorl.model.gemma3 import Gemma3Block
from monorl.model.gpt_oss import GptOssBlock
from monorl.model.layers import Linear, RMSNorm, embedding
from monorl.model.qwen3_5 import Qwen3_5Block
from monorl.model.rope import model_rope

# A family whose decoder layer differs from the Llama-shaped `TransformerBlock` (other norms, another token mixer
# on some layers) registers its block class here, keyed by model_type: `block(cfg, layer_index, fused)`. Every
# layer gets (x, cos, sin, ctx, cache) and returns x; what it reads from `cache` is its layer kind's state
# (`monorl.generate.cache.cache_kinds`, by `cfg.layer_type(i)`).
# A block class may also name the model's final norm (`final_norm`) and ask for embeddings scaled by
# sqrt(hidden_size) (`embed_scale`), as Gemma 3's does.
FAMILY_BLOCKS: dict[str, Callable[[ModelConfig, int, bool], nn.Module]] = {
    "gemma3_text": Gemma3Block, "qwen3_5_text": Qwen3_5Block, "qwen3_5_moe_text": Qwen3_5Block, "gpt_oss": GptOssBlock}


def make_block(cfg: ModelConfig, i: int, fused: bool) -> nn.Module:
    """Layer i of a `cfg` model: its family's registered block, else the Llama-shaped one."""
    if (block := FAMILY_BLOCKS.get(cfg.model_type)) is not None:
        return block(cfg, i, fused)
    return TransformerBlock(cfg, fused, cfg.sparse_layer(i))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_block(cfg, i, fused) for i in range(cfg.num_layers))
        norm = getattr(FAMILY_BLOCKS.get(cfg.model_type), "final_norm", RMSNorm)
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.vision is not None:  # a vision-language model's tower (HF: model.visual)
            from monorl.model.vision import VisionTower

            self.visual = VisionTower(cfg.vision)


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
        self.embed_scale = cfg.hidden_size ** 0.5 if getattr(FAMILY_BLOCKS.get(cfg.model_type), "embed_scale",
                                                             False) else None

    @property
    def lm_head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext,
                kv_cache: Sequence[Any] | None = None, rope: tuple[Tensor, Tensor] | None = None,
                inputs_embeds: Tensor | None = None,
                deepstack: tuple[Tensor, Sequence[Tensor]] | None = None) -> Tensor:
        """input_ids, positions: [T] ([3, T] for M-RoPE). kv_cache: one entry per layer (or None), handed to
        `ctx.attend`. rope: the positions' `rope_cos_sin` in the activations' dtype, where the caller has them (the
        generator's decode step gathers them from tables of every position: `monorl.ops.decode_state`).
        inputs_embeds: [T, hidden] in place of the token embeddings (image tokens replaced by the tower's:
        `monorl.model.qwen3_vl.embed_images`); deepstack: (token indices, one [n, hidden] tensor per layer), each
        added to those tokens' hidden states after layer i."""
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embed_scale is not None:  # the scale rounded to the activations' dtype first, as HF's (Gemma)
            x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)
        ropes = self.rope_by_layer_type(positions, x.dtype, rope)
        mark_dynamic(x, *(t for cs in ropes.values() for t in cs), dims=(0,))  # token counts vary
        checkpointed = self.activation_checkpointing and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            cache = None if kv_cache is None else kv_cache[i]
            cos, sin = ropes[self.config.rope_kind(i)]
            if checkpointed:  # keeps only x; no RNG inside, so no RNG save/restore (CUDA-graph capturable)
                x = checkpoint(layer, x, cos, sin, ctx, cache, use_reentrant=False, preserve_rng_state=False)
            else:
                x = layer(x, cos, sin, ctx, cache)
            if deepstack is not None and i < len(deepstack[1]):
                x = _add_rows(x, deepstack[0], deepstack[1][i])
        return self.model.norm(x)  # a fused-kernels model's norm takes the last block's pending (h, m) pair itself

    def rope_by_layer_type(self, positions: Tensor, dtype: torch.dtype,
                           rope: tuple[Tensor, Tensor] | None = None) -> dict[str, tuple[Tensor, Tensor]]:
        """cos / sin of `positions` for each RoPE kind the layers use (`ModelConfig.rope_kind`: one for the
        families whose layers all rotate alike). rope: given by the caller (the decode step), for the one kind."""
        kinds = dict.fromkeys(self.config.rope_kind(i) for i in range(self.config.num_layers))
        if rope is not None:
            assert len(kinds) == 1, "a precomputed rope serves a model with one RoPE kind"
            return dict.fromkeys(kinds, rope)
        return {kind: model_rope(self.config, positions, dtype, kind) for kind in kinds}

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
        identity = {f"{n}.weight": getattr(m, "identity_weight", 1.0) for n, m in self.named_modules()}
        # every norm's scale, the vision tower's LayerNorms (norm1, norm2) included
        norms = {f"{n}.weight" for n, m in self.named_modules() if "Norm" in type(m).__name__}
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name in norms:
                p.fill_(identity.get(name, 1.0))  # the unit scale (a (1 + w) norm's: 0)
                continue
            if p.device not in gens:
                gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.copy_(torch.randn(p.shape, generator=gens[p.device], dtype=torch.float32, device=p.device) * std)
        return self


def _add_rows(x: Tensor | tuple[Tensor, Tensor], index: Tensor, rows: Tensor) -> Tensor | tuple[Tensor, Tensor]:
    """x with `rows` added at `index` (DeepStack); a fused-kernels block's pending pair (h, m) gets them on h."""
    if isinstance(x, tuple):
        return x[0].index_add(0, index, rows.to(x[0].dtype)), x[1]
    return x.index_add(0, index, rows.to(x.dtype))


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
