"""Advantages: each completion's reward against a baseline (its group's, or the batch's).

GRPO (DeepSeekMath; TRL, verl): ``A = (r - mean_group(r)) / (std_group(r) + eps)`` with the *sample* standard
deviation (Bessel-corrected, ``torch.std``'s default, as TRL and verl use). ``eps`` is 1e-6 here, as verl's;
TRL 1.16 adds 1e-4.

Dr. GRPO (Liu et al. 2025) and the TorchTitan RL reference drop the std division: ``A = r - mean_group(r)``
(``normalize_std=False``). The reference's `rl_grpo_qwen3_0_6b` loop computes exactly that mean-only
advantage, so reference parity means ``normalize_std=False``.

RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs", arXiv:2402.14740): the leave-one-out baseline, ``A_i = r_i - mean_{j != i} r_j`` within the
group, which equals ``G / (G - 1) * (r_i - mean_group(r))``; no std division. Peers: verl
`compute_rloo_outcome_advantage` (verl/trainer/ppo/core_algos.py), TRL's RLOOTrainer (trl/trainer/rloo_trainer.py).

REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
arXiv:2501.03262): the advantage is normalised over the whole batch, ``A = (x - mean_batch(x)) /
(std_batch(x) + eps)``, with ``x = r`` (REINFORCE++, needs no group: group_size 1 is fine) or ``x = r -
mean_group(r)`` (REINFORCE++-baseline). Peers: verl `compute_reinforce_plus_plus_outcome_advantage` and
`compute_reinforce_plus_plus_baseline_outcome_advantage` (verl/trainer/ppo/core_algos.py), OpenRLHF's
`advantage_estimator` "reinforce" / "reinforce_baseline". Two differences from those, both deliberate: the batch
statistics here are over sequences (one advantage each), while verl / OpenRLHF whiten per-token returns, which
weights each sequence by its length; and the KL is not folded into the reward per token as REINFORCE++ does (use
the loss's KL penalty). The std is the sample std, as for GRPO.

A group (for the batch kinds: a batch) whose values are all equal carries no signal: its advantages are exactly
0 (the centred values are set to exactly 0, never 0/0).

Unscorable completions (no reward component applied to them) come in as NaN rewards, TRL 1.16's marker, and follow
TRL 1.16's rule (`GRPOTrainer` / `RLOOTrainer._generate_and_score_completions`): their advantage is exactly 0, and
every statistic -- the group mean and sample std, RLOO's leave-one-out mean over the scorable others, the batch
statistics of the REINFORCE++ kinds (which TRL does not have; the same rule carried over) -- is taken over the
scorable completions only. A group with fewer than two scorable completions has no signal: all 0.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

AdvantageKind = Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
ADVANTAGE_KINDS: tuple[str, ...] = get_args(AdvantageKind)
GROUPLESS_ADVANTAGE_KINDS = ("reinforce_pp",)  # need no group: valid with group_size 1


def _as_groups(rewards: Tensor | list[float], group_size: int) -> Tensor:
    """Validated fp32 rewards (shape kept); NaN marks an unscorable completion, inf is refused."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if r.dim() == 2:
        if r.shape[1] != group_size:
            raise ValueError(f"rewards of shape {tuple(r.shape)} do not have groups of {group_size}")
    elif r.dim() != 1 or r.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(r.shape)} do not split into groups of {group_size}: "
                         f"expected [P*{group_size}] or [P, {group_size}]")
    if torch.isinf(r).any():
        raise ValueError("rewards contain inf")
    return r


def _nanmean(x: Tensor, dim: int | None = None) -> Tensor:
    """The mean over the non-NaN values (NaN where there are none), kept dims when `dim` is given."""
    return torch.nanmean(x, dim=dim, keepdim=dim is not None)


def _nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """The sample std (Bessel-corrected) over the non-NaN values; NaN where there are fewer than two."""
    keep = dim is not None
    count = (~x.isnan()).sum(dim=dim, keepdim=keep)
    sq = ((x - _nanmean(x, dim)) ** 2).nan_to_num(0.0).sum(dim=dim, keepdim=keep)
    return torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.nan).sqrt()


def _flat(g: Tensor, dim: int | None = None) -> Tensor:
    """True where the non-NaN values are all equal (also: fewer than two of them): no signal."""
    lo = g.nan_to_num(nan=torch.inf).amin(dim=dim, keepdim=dim is not None)
    hi = g.nan_to_num(nan=-torch.inf).amax(dim=dim, keepdim=dim is not None)
    count = (~g.isnan()).sum(dim=dim, keepdim=dim is not None)
    return (count < 2) | (lo == hi)


def group_advantages(rewards: Tensor | list[float], group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """rewards ``[P * group_size]`` (consecutive completions of a prompt adjacent) or ``[P, group_size]`` ->
    fp32 advantages of the same shape.

    With ``group_size == 1`` every advantage is 0 (a lone completion has nothing to be compared with). NaN
    rewards (unscorable) get 0 and are left out of the group's mean and std (TRL 1.16's rule: module docstring).
    """
    r = _as_groups(rewards, group_size)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    g = r.reshape(-1, group_size)
    adv = g - _nanmean(g, dim=1)
    if normalize_std and group_size > 1:
        adv = adv / (_nanstd(g, dim=1) + eps)
    # The float mean of equal values need not equal them (0.1 * 3 / 3), which would leave tiny nonzero
    # advantages that the std division then blows up: zero such groups exactly (and NaN rewards' NaN advantages).
    adv = adv.masked_fill(_flat(g, dim=1), 0.0).nan_to_num(0.0)
    return adv.reshape(r.shape)


def rloo_advantages(rewards: Tensor | list[float], group_size: int) -> Tensor:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j`` within each group (group_size >= 2), the mean over the scorable
    others (NaN rewards: advantage 0); same shapes as `group_advantages`."""
    r = _as_groups(rewards, group_size)
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2 (a leave-one-out baseline of others), got {group_size}")
    g = r.reshape(-1, group_size)
    count = (~g.isnan()).sum(dim=1, keepdim=True)
    adv = g - (g.nansum(dim=1, keepdim=True) - g) / (count - 1).clamp(min=1)
    adv = adv.masked_fill(_flat(g, dim=1), 0.0).nan_to_num(0.0)  # exactly 0, as in group_advantages
    return adv.reshape(r.shape)


def reinforce_pp_advantages(rewards: Tensor | list[float], group_size: int, baseline: bool,
                            eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (``baseline=False``: raw rewards) or REINFORCE++-baseline (``baseline=True``: group mean
    subtracted first), then normalised over the whole batch: ``(x - mean(x)) / (std(x) + eps)``, sample std.
    Same shapes as `group_advantages`; group_size 1 is valid without the baseline (and gives zeros with it). NaN
    rewards: advantage 0, left out of every mean and std."""
    r = _as_groups(rewards, group_size)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    x = r
    if baseline:  # the group mean subtracted (equal groups exactly 0); unscorable completions stay NaN
        x = group_advantages(r, group_size, normalize_std=False).masked_fill(r.isnan(), torch.nan)
    flat = x.reshape(-1)
    if _flat(flat):  # no signal in the batch (also a batch of one): exactly 0, never 0/0
        return torch.zeros_like(x)
    flat = (flat - _nanmean(flat)) / (_nanstd(flat) + eps)
    return flat.nan_to_num(0.0).reshape(r.shape)


def compute_advantages(rewards: Tensor | list[float], group_size: int, kind: str = "grpo",
                       normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """The advantage of `kind` (one of ADVANTAGE_KINDS); `normalize_std` applies to "grpo" only (the group
    std: False is Dr. GRPO's mean-only advantage)."""
    if kind == "grpo":
        return group_advantages(rewards, group_size, normalize_std=normalize_std, eps=eps)
    if kind == "rloo":
        return rloo_advantages(rewards, group_size)
    if kind in ("reinforce_pp", "reinforce_pp_baseline"):
        return reinforce_pp_advantages(rewards, group_size, baseline=kind == "reinforce_pp_baseline", eps=eps)
    raise ValueError(f"advantage kind must be one of {ADVANTAGE_KINDS}, got {kind!r}")
