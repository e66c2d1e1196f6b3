"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476, section 3.2): a group whose completions are all correct or all wrong (eq. 11) adds nothing but
noise and normaliser weight to the step, so it is dropped, and further prompts are sampled until the batch holds
`prompts_per_step` groups that carry signal.

What "all the same" is measured on (`rollout.dynamic_sampling_metric`, verl's `metric`): by default the task's
pass component (accuracy: DAPO's and verl's recipe), so an all-wrong group whose lengths differ -- whose total
reward differs only by the overlong penalty -- is dropped; "reward" filters on the total reward.

Peers: verl's DAPO recipe (recipe/dapo/dapo_ray_trainer.py: `filter_groups`, `max_num_gen_batches`) draws a
whole generation batch per round and fails the step past the cap. Here a round after the first draws what the
keep rate so far says the deficit needs (at most `prompts_per_step` prompts, at least the deficit), and past
the cap (`max_rounds` rounds, the first included) the step trains on the groups it has: fewer groups, or, when
no group had signal, the first round's, as without the filter (on the total reward: all advantages 0, so the
step moves the weights only through a KL term). Surplus groups of the last round are left out; every prompt
drawn is consumed from the stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from monorl.rl.rollouts.metrics import zero_std
from monorl.rl.rollouts.rollout import Rollout

REWARD = "reward"  # dynamic_sampling_metric's name for the total reward


def sampling_metric(configured: str | None, components: tuple[str, ...], pass_component: str | None) -> str:
    """The value dynamic sampling filters on: `configured` (a reward component of the run, or "reward"), else the
    pass component (validation.pass_component, else the task's first component), else "reward"."""
    if configured is None:
        return pass_component or REWARD
    if configured != REWARD and configured not in components:
        raise ValueError(f"rollout.dynamic_sampling_metric {configured!r} is neither {REWARD!r} nor a reward component "
                         f"of the run ({', '.join(components) or 'none'})")
    return configured


def has_signal(group: list[Rollout], metric: str = REWARD) -> bool:
    """The group's `metric` differs between its completions: among the scorable ones for "reward", among those
    the component applies to (not None) for a component."""
    if metric == REWARD:
        return not zero_std(group)
    values = [v for r in group if (v := r.rewards.get(metric)) is not None]
    return any(v != values[0] for v in values)


@dataclass
class SampledBatch:
    groups: list[list[Rollout]]  # the step's batch
    rounds: int  # generation rounds used
    sampled_groups: int  # groups generated over all rounds
    zero_std_groups: int  # of those, groups whose rewards were all equal

    def metrics(self, dynamic: bool) -> dict[str, float]:
        """frac_reward_zero_std over every group sampled (the reward's, whatever the filter's metric); with
        dynamic sampling also dynamic_sampling/rounds, /sampled_groups, /groups (in the batch) and /dropped_groups
        (sampled, not in the batch: no signal in the filter's metric, or surplus of the last round)."""
        out: dict[str, float] = {"frac_reward_zero_std": self.zero_std_groups / max(1, self.sampled_groups)}
        if dynamic:
            out.update({"dynamic_sampling/rounds": self.rounds, "dynamic_sampling/sampled_groups": self.sampled_groups,
                        "dynamic_sampling/groups": len(self.groups),
                        "dynamic_sampling/dropped_groups": self.sampled_groups - len(self.groups)})
        return out


def round_size(prompts_per_step: int, kept: int, sampled: int) -> int:
    """Prompts to draw in the next round: the deficit divided by the keep rate seen so far, between the deficit
    and prompts_per_step (a whole batch when nothing was kept yet)."""
    deficit = prompts_per_step - kept
    if kept == 0:
        return prompts_per_step
    return max(deficit, min(prompts_per_step, math.ceil(deficit * sampled / kept)))


def fill_batch(draw: Callable[[int, int], list[list[Rollout]]], prompts_per_step: int, dynamic: bool,
               max_rounds: int, metric: str = REWARD) -> SampledBatch:
    """`draw(n, round)` generates and scores the groups of the next `n` prompts (round 0, 1, ...). Without
    `dynamic` one round of prompts_per_step; with it, DAPO's filter on `metric` (`sampling_metric`; see the module
    docstring)."""
    first = draw(prompts_per_step, 0)
    zero = sum(zero_std(g) for g in first)
    if not dynamic:
        return SampledBatch(first, 1, len(first), zero)
    kept = [g for g in first if has_signal(g, metric)]
    sampled, rounds = len(first), 1
    while len(kept) < prompts_per_step and rounds < max_rounds:
        groups = draw(round_size(prompts_per_step, len(kept), sampled), rounds)
        rounds += 1
        sampled += len(groups)
        zero += sum(zero_std(g) for g in groups)
        kept += [g for g in groups if has_signal(g, metric)]
    return SampledBatch(kept[:prompts_per_step] or first, rounds, sampled, zero)
