"""AdamW and the learning-rate schedule (linear warmup, then linear/cosine decay or constant)."""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

import torch

from monorl.speedups.private_apis import unwrapped_methods

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


_UNWRAPPED = unwrapped_methods(torch.optim.AdamW,
                               ("add_param_group", "zero_grad", "state_dict", "load_state_dict", "step"))


class AdamW(torch.optim.AdamW):
    """torch's AdamW (the same update, state and state dict), its methods reached past the wrappers that import
    torch._dynamo at their first call: `torch._disable_dynamo` on add_param_group, zero_grad, state_dict and
    load_state_dict, `_use_grad_for_differentiable` on step. A run that compiles nothing then never imports Dynamo
    (0.9-1.5 s on the GPU machines, #18). Those wrappers exist for an optimizer traced by torch.compile, which
    monorl never does (it compiles the model's blocks only)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _UNWRAPPED["add_param_group"](self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _UNWRAPPED["zero_grad"](self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _UNWRAPPED["state_dict"](self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _UNWRAPPED["load_state_dict"](self, state_dict)

    def step(self, closure: Any = None) -> Any:
        with torch.no_grad():  # what the step's wrapper does, but for `differentiable` (never set here)
            return _UNWRAPPED["step"](self, closure)


def make_optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float, betas: tuple[float, float],
                   eps: float) -> AdamW:
    """AdamW, fused on CUDA (one kernel for all parameters)."""
    fused = all(p.is_cuda for p in params)
    return AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True if fused else None)


def clip_and_step(params: list[torch.nn.Parameter], optimizer: AdamW, max_norm: float,
                  on_device: bool) -> tuple[torch.Tensor | float, torch.Tensor | bool]:
    """Clip the gradients of `params` to a total norm of max_norm and step `optimizer`; a non-finite norm skips the
    update (weights and moments untouched). Returns (norm, skipped). on_device (a fused optimizer on one rank): both
    stay device tensors and the skip is fused AdamW's `found_inf`, so nothing waits for the GPU; else the norm is read
    here first."""
    if on_device:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        skipped = (~torch.isfinite(norm)).float()
        # the clip rides on fused AdamW's grad_scale (each gradient divided by it in the update's own pass, not
        # scaled in a pass of its own): clip_grad_norm_'s min(max / (norm + 1e-6), 1), inverted
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
        optimizer.found_inf = skipped
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
        return norm, skipped
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if math.isfinite(norm):
        optimizer.step()
    return norm, not math.isfinite(norm)


def launch_update_kernels(device: torch.device, on_device: bool) -> None:
    """`clip_and_step` and `zero_grad` once on a throwaway one-element parameter: their kernels' first launches (CUDA
    loads each kernel's module then, 5-70 ms each on the GPU machines), which the ATen preload of a later run
    (`monorl.speedups.preload`) can then pay in its thread when this runs under its recorder. Touches nothing of a
    run."""
    p = torch.nn.Parameter(torch.zeros(1, device=device))
    p.grad = torch.ones(1, device=device)
    opt = AdamW([p], lr=1e-3, fused=True if on_device else None)
    clip_and_step([p], opt, 1.0, on_device)
    opt.zero_grad(set_to_none=False)
