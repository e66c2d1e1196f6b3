"""RoPE's formula, rotate-half (non-interleaved) as in HF: the model's (`monorl.model.decoder`) and the fused block
kernels' CPU path (`block_kernels.qk_norm_rope`), one definition for both; `partial_rope` for heads that rotate only
their first dims (Qwen3.5's full-attention layers)."""

from __future__ import annotations

import torch
from torch import Tensor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos/sin: [T, D]. Non-interleaved (rotate-half) RoPE as in HF."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`apply_rope` of the first cos.shape[-1] dims of x's heads [T, H, D], the rest passed through (HF's
    partial_rotary_factor: Qwen3.5's full-attention layers); all of them where cos is as wide as the heads."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
