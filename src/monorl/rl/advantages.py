"""Group-relative advantages: each completion's reward against the other completions of the same prompt.

GRPO (DeepSeekMath; TRL, verl): ``A = (r - mean_group(r)) / (std_group(r) + eps)`` with the *sample* standard
deviation (Bessel-corrected, ``torch.std``'s default, as TRL and verl use).

Dr. GRPO (Liu et al. 2025) and the TorchTitan RL reference drop the std division: ``A = r - mean_group(r)``
(``normalize_std=False``). The reference's `rl_grpo_qwen3_0_6b` loop computes exactly that mean-only
advantage, so reference parity means ``normalize_std=False``.

A group whose rewards are all equal carries no signal: its advantages are exactly 0 either way (the centred
rewards are set to exactly 0, never 0/0).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor | list[float], group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """rewards ``[P * group_size]`` (consecutive completions of a prompt adjacent) or ``[P, group_size]`` ->
    fp32 advantages of the same shape.

    With ``group_size == 1`` every advantage is 0 (a lone completion has nothing to be compared with).
    """
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if r.dim() == 2:
        if r.shape[1] != group_size:
            raise ValueError(f"rewards of shape {tuple(r.shape)} do not have groups of {group_size}")
    elif r.dim() != 1 or r.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(r.shape)} do not split into groups of {group_size}: "
                         f"expected [P*{group_size}] or [P, {group_size}]")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf")
    g = r.reshape(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    # The float mean of equal values need not equal them (0.1 * 3 / 3), which would leave tiny nonzero
    # advantages that the std division then blows up: zero such groups exactly.
    same = (g == g[:, :1]).all(dim=1, keepdim=True)
    adv = adv.masked_fill(same, 0.0)
    return adv.reshape(r.shape)
