"""AdamW and the learning-rate schedule (linear warmup, then linear/cosine decay or constant)."""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

Schedule = Literal["linear", "cosine", "constant"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose from {SCHEDULES}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def make_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float, betas: tuple[float, float],
                   eps: float) -> torch.optim.AdamW:
    """AdamW, fused on CUDA (one kernel for all parameters)."""
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=True if fused else None)
