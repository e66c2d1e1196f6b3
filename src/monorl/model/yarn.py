"""YaRN RoPE scaling (HF rope_type "yarn", GPT-OSS's): its config.json parameters (`YarnRopeScaling`, read the way
transformers' `_compute_yarn_parameters` resolves them) and its inverse frequencies (`yarn_inv_freq`, in HF's
operation order, so the same fp32 values). The cos / sin tables are multiplied by `attention_factor` before their
cast (HF's `attention_scaling`): `monorl.model.rope.rope_cos_sin`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

_KEYS = {"rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow", "truncate", "attention_factor",
         "mscale", "mscale_all_dim", "original_max_position_embeddings"}


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnRopeScaling:
    """Interpolate the long wavelengths by `factor`, keep the short ones, a linear ramp between (bounded by
    beta_fast / beta_slow rotations over original_max_position_embeddings), and scale cos / sin by
    attention_factor (resolved: HF's default 0.1 ln(factor) + 1)."""

    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int
    truncate: bool
    attention_factor: float

    @staticmethod
    def from_hf(rope: dict[str, Any], max_position_embeddings: int) -> YarnRopeScaling:
        """A config.json's yarn rope_parameters; ValueError (one line, naming the key) for what HF would reject."""
        if extra := sorted(set(rope) - _KEYS):
            raise ValueError(f"config.json: unsupported yarn rope_parameters keys {extra}")
        original = rope.get("original_max_position_embeddings")
        if not (isinstance(original, int) and not isinstance(original, bool) and original > 0):
            raise ValueError(f"config.json: yarn original_max_position_embeddings must be a positive integer, "
                             f"got {original!r}")
        factor = rope.get("factor")
        factor = max_position_embeddings / original if factor is None else factor
        for key, value in (("factor", factor), ("beta_fast", rope.get("beta_fast") or 32),
                           ("beta_slow", rope.get("beta_slow") or 1)):
            if not (isinstance(value, int | float) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"config.json: yarn {key} must be a positive number, got {value!r}")
        attention = rope.get("attention_factor")
        if attention is None:
            mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = (_mscale(factor, mscale) / _mscale(factor, all_dim) if mscale and all_dim
                         else _mscale(factor))
        truncate = rope.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"config.json: yarn truncate must be true or false, got {truncate!r}")
        return YarnRopeScaling(float(factor), float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
                               original, truncate, float(attention))

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "yarn", "factor": self.factor, "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                "truncate": self.truncate, "original_max_position_embeddings": self.original_max_position_embeddings,
                "attention_factor": self.attention_factor}

    def params(self) -> list[float]:
        """The list `rope_cos_sin` takes (a custom op's argument: floats only)."""
        return [self.factor, self.beta_fast, self.beta_slow, float(self.original_max_position_embeddings),
                float(self.truncate), self.attention_factor]


def yarn_inv_freq(dim: int, base: float, device: torch.device, factor: float, beta_fast: float, beta_slow: float,
                  original: float, truncate: float) -> Tensor:
    """HF's `_compute_yarn_parameters` inverse frequencies [dim // 2] (fp32)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: no singular ramp
    # built on `device`: a CPU tensor copied in would break CUDA graph capture
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, device=device).float() - low) / (high - low), 0, 1)
    keep = 1 - ramp  # HF's inv_freq_extrapolation_factor
    return interpolation * (1 - keep) + extrapolation * keep
