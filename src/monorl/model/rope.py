"""RoPE for every family: cos / sin tables of positions (`rope_cos_sin`, with Llama 3's frequency scaling) and the
rotation as one op opaque to `torch.compile` (`rope`), so the trainer and the generator rotate by the same bits."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from monorl.model.config import Llama3RopeScaling, ModelConfig
from monorl.model.mrope import mrope_cos_sin
from monorl.model.yarn import YarnRopeScaling, yarn_inv_freq
from monorl.ops import custom_op
from monorl.ops.rope import apply_rope


@custom_op("monorl::rope_cos_sin", mutates_args=())
def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 llama3: list[float] | None = None, yarn: list[float] | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin [T, head_dim] for the given positions (computed in fp32, cast like HF does); llama3: Llama 3's
    frequency scaling (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings). A custom op,
    so these are eager's values under `torch.compile` too (Inductor's pow, divide and cos may round differently):
    a whole-model compiled trainer and an uncompiled generator then rotate by the same bits (batch-invariant
    mode). `model_rope` passes a config's parameters. yarn: `YarnRopeScaling.params()` (its inverse frequencies, and
    cos / sin times its attention factor in fp32 before the cast, as HF scales them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    if llama3 is not None:
        inv_freq = _llama3_inv_freq(inv_freq, *llama3)
    if yarn is not None:
        inv_freq = yarn_inv_freq(head_dim, theta, positions.device, *yarn[:5])
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if yarn is not None:
        return (emb.cos() * yarn[5]).to(dtype), (emb.sin() * yarn[5]).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@rope_cos_sin.register_fake
def _(positions, head_dim, theta, dtype, llama3=None, yarn=None):
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


def model_rope(cfg: ModelConfig, positions: Tensor, dtype: torch.dtype,
               kind: str = "default") -> tuple[Tensor, Tensor]:
    """`rope_cos_sin` with the config's RoPE parameters for layers of RoPE kind `kind` (`ModelConfig.rope_kind`;
    a family whose layer kinds rotate differently, e.g. another base on sliding-window layers, adds its case
    here). "mrope": a vision-language model's (`monorl.model.mrope`), positions [3, T] or [T]."""
    if kind == "mrope":
        return mrope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, list(cfg.vision.mrope_section), dtype)
    if kind == "local":  # Gemma 3's sliding-window layers: their own base, no scaling (HF scales full layers only)
        return rope_cos_sin(positions, cfg.head_dim, cfg.rope_local_theta, dtype, None)
    s: Llama3RopeScaling | YarnRopeScaling | None = cfg.rope_scaling
    if isinstance(s, YarnRopeScaling):  # GPT-OSS
        return rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, dtype, None, s.params())
    llama3 = None if s is None else [s.factor, s.low_freq_factor, s.high_freq_factor,
                                     float(s.original_max_position_embeddings)]
    return rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, dtype, llama3)  # rotary_dim: head_dim unless partial


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

