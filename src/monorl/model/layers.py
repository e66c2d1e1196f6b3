"""The decoder's plain building blocks: the RMSNorm, the projection class every conversion recognises, the
embedding. Their own module so that the dense decoder (`decoder.py`) and the sparse MLP (`moe.py`) both build on
them without importing each other."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from monorl.ops import offset_rmsnorm, rmsnorm_invariant


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


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in fp32, cast to x's dtype after the scale: the (1 + w) RMSNorm of Gemma 3 and Qwen3.5
    (HF's Gemma3RMSNorm / Qwen3_5RMSNorm, the same rounding); w stored as HF stores it, 0 the identity scale."""

    identity_weight = 0.0  # the weight of the identity scale (`DecoderForCausalLM.init_weights`)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return offset_rmsnorm.offset_rms_norm_reference(x, self.weight, self.eps)


class FusedOffsetRMSNorm(OffsetRMSNorm):
    """The generator's CUDA copy of a family with its own decoder layers (`monorl.model.fused_kernels.
    use_fused_norms_`): one kernel a norm (`monorl.ops.offset_rmsnorm`), forward only."""

    def forward(self, x: Tensor) -> Tensor:
        return offset_rmsnorm.offset_rms_norm(x, self.weight, self.eps)


class BatchInvariantOffsetRMSNorm(OffsetRMSNorm):
    """The batch-invariant norm (`monorl.model.batch_invariant`): the invariant kernel on fp32 rows, scale 1 + w,
    w as the compute dtype holds it: the trainer's fp32 master rounded to the generator's bf16 copy (1 + w in fp32
    of an unrounded master differed from the generator's after the first optimizer step: Gemma 3 270M, H100)."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.to(x.dtype).float()
        return rmsnorm_invariant.bi_rms_norm(x.float(), 1.0 + w, self.eps).to(x.dtype)
