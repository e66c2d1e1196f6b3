"""RoPE's formula, rotate-half (non-interleaved) as in HF: the model's (`monorl.model.decoder`) and the fused block
kernels' CPU path (`block_kernels.qk_norm_rope`), one definition for both."""

from __future__ import annotations

import torch
from torch import Tensor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos/sin: [T, D]. Non-interleaved (rotate-half) RoPE as in HF."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
