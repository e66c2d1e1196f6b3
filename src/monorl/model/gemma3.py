"""Gemma 3's decoder layer (transformers' Gemma3DecoderLayer, text only), registered in
`monorl.model.decoder.FAMILY_BLOCKS` for model_type "gemma3_text".

What differs from the Llama-shaped `TransformerBlock`: a norm before *and after* attention and the MLP (four per
layer), each a (1 + w) RMSNorm (`OffsetRMSNorm`: weights stored as HF stores them, 0 meaning the identity scale;
normalise and scale in fp32, then cast), a q/k norm of the same kind, GeGLU with tanh GELU, attention scores scaled
by `query_pre_attn_scalar ** -0.5`, and on "sliding_attention" layers a window of `sliding_window` keys with a RoPE
base of their own (`ModelConfig.rope_kind`). The embedding is scaled by sqrt(hidden_size) in the activations' dtype
(`embed_scale`, read by `DecoderForCausalLM`), and the final norm is a `OffsetRMSNorm` too (`final_norm`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from monorl.model.attention import AttentionContext
from monorl.model.blocks import Attention
from monorl.model.config import ModelConfig
from monorl.model.layers import OffsetRMSNorm
from monorl.model.mlp import MLP


class Gemma3Attention(Attention):
    """GQA attention with a (1 + w) q/k norm and `query_pre_attn_scalar`; a sliding layer attends its last `window`
    keys."""

    norm_class = OffsetRMSNorm

    def __init__(self, cfg: ModelConfig, layer_index: int, fused: bool = False) -> None:
        super().__init__(cfg, fused, layer_index)
        # every context scales scores by head_dim ** -0.5: q is scaled by the rest of query_pre_attn_scalar ** -0.5
        # (exactly 1, so nothing, where they are equal: every released Gemma 3 but 27B)
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.q_scale = 1.0 if scalar == cfg.head_dim else math.sqrt(cfg.head_dim / scalar)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        o = ctx.attend(q, k, v, cache, window=self.window)
        return self.o_proj(o.flatten(1))


class Gemma3MLP(MLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    act = staticmethod(partial(F.gelu, approximate="tanh"))


class Gemma3Block(nn.Module):
    """One Gemma 3 decoder layer: x + post_norm(attn(pre_norm(x))), then the same around the MLP."""

    final_norm = OffsetRMSNorm  # the model's final norm (`monorl.model.decoder.Qwen3Model`)
    embed_scale = True  # embeddings times sqrt(hidden_size), in their dtype (`DecoderForCausalLM.forward`)

    def __init__(self, cfg: ModelConfig, layer_index: int, fused: bool = False) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_index, fused)
        self.mlp = Gemma3MLP(cfg, fused)
        eps = cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(cfg.hidden_size, eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext, cache: Any = None) -> Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
