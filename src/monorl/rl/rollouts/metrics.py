"""A batch's rollout metrics: rewards (mean, std, per component, groups without signal), completion lengths, and
validation's results (`ValidationResult`, `summarize`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from monorl.rl.rollouts.passk import mean_at_k, mean_pass_at_k, passes
from monorl.rl.rollouts.rollout import Rollout


@dataclass
class ValidationResult:
    """Validation on the held-out prompts: `k` completions each (greedy when k is 1). `components` are each
    reward component's mean over the completions it applies to (None: it applied to none). A completion
    *passes* when its `pass_component` is >= the run's validation.pass_threshold: `pass_at_k` is the share of
    prompts with a passing completion among their k, `mean_at_k` the share of passing completions."""

    mean_reward: float
    components: dict[str, float | None]
    mean_length: float
    k: int = 1
    pass_at_k: float | None = None
    mean_at_k: float | None = None
    pass_component: str | None = None
    skipped: bool = False  # no held-out prompts: nothing was validated

    def line(self) -> str:
        if self.skipped:
            return "skipped (no held-out prompts)"
        comps = ", ".join(f"{k}={fmt_value(v)}" for k, v in self.components.items())
        line = f"mean_reward={self.mean_reward:+.3f} ({comps})"
        if self.pass_at_k is not None and self.mean_at_k is not None:
            line += f" pass@{self.k}={self.pass_at_k:.3f} mean@{self.k}={self.mean_at_k:.3f}"
        return line

    def metrics(self, prefix: str = "val/") -> dict[str, Any]:
        """Flat keys for a metrics row: mean_reward, mean_length, pass@k, mean@k, rewards/<c>/mean."""
        out: dict[str, Any] = {f"{prefix}mean_reward": self.mean_reward, f"{prefix}mean_length": self.mean_length}
        if self.pass_at_k is not None:
            out[f"{prefix}pass@{self.k}"] = self.pass_at_k
            out[f"{prefix}mean@{self.k}"] = self.mean_at_k
        out.update({f"{prefix}rewards/{c}/mean": v for c, v in self.components.items()})
        return out


def fmt_value(v: float | None) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:+.3f}"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _std(xs: list[float]) -> float | None:
    """Sample standard deviation (Bessel-corrected, as torch.std and TRL's nanstd); None below 2 values."""
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def component_values(rollouts: list[Rollout], component: str) -> list[float]:
    """The values of one reward component over the rollouts it applies to (None values left out)."""
    return [v for r in rollouts if (v := r.rewards.get(component)) is not None]


def summarize(groups: list[list[Rollout]], components: tuple[str, ...], pass_component: str | None = None,
              pass_threshold: float = 1.0) -> ValidationResult:
    """Mean reward (over the scorable completions; 0.0 when none is), each component's mean over the completions
    it applies to, mean length; with a `pass_component`, pass@k and mean@k with k the group size (see
    `ValidationResult`)."""
    flat = [r for g in groups for r in g]
    if not flat:
        return ValidationResult(0.0, {c: None for c in components}, 0.0, skipped=not groups)
    comps = {c: _mean(component_values(flat, c)) for c in components}
    k = len(groups[0])
    result = ValidationResult(_mean(scored_rewards(flat)) or 0.0, comps,
                              sum(len(r.completion_ids) for r in flat) / len(flat), k=k)
    if pass_component is not None:
        passed = [[passes(r.rewards, pass_component, pass_threshold) for r in g] for g in groups]
        result.pass_component = pass_component
        result.pass_at_k = mean_pass_at_k(passed, k)
        result.mean_at_k = mean_at_k([[float(p) for p in g] for g in passed])
    return result


def scored_rewards(rollouts: list[Rollout]) -> list[float]:
    """The rewards of the scorable rollouts (unscorable ones are left out, TRL 1.16's rule: `Rollout.scorable`)."""
    return [r.reward for r in rollouts if r.scorable]


def zero_std(group: list[Rollout]) -> bool:
    """The group's scorable rewards are all equal (or fewer than two): its advantages are 0 and it carries no
    learning signal."""
    rewards = scored_rewards(group)
    return all(x == rewards[0] for x in rewards)


# ---- one step ------------------------------------------------------------------------------------------

def reward_metrics(groups: list[list[Rollout]], components: tuple[str, ...]) -> dict[str, Any]:
    """Reward metrics under TRL's names: reward (the mean over the scorable completions, NaN when none is, as TRL
    1.16), reward_std (monorl's: the mean over groups of each group's sample std over its scorable completions;
    TRL 1.16 logs the whole batch's std), frac_reward_zero_std (share of groups without signal: `zero_std`), and
    per component rewards/<c>/mean and /std over the completions it applies to (None where it applies to none),
    as TRL's."""
    flat = [r for g in groups for r in g]
    out: dict[str, Any] = {
        "reward": _mean(scored_rewards(flat)) if any(r.scorable for r in flat) else math.nan,
        "reward_std": sum(_std(scored_rewards(g)) or 0.0 for g in groups) / len(groups),
        "frac_reward_zero_std": sum(zero_std(g) for g in groups) / len(groups),
    }
    for c in components:
        vals = component_values(flat, c)
        out[f"rewards/{c}/mean"], out[f"rewards/{c}/std"] = _mean(vals), _std(vals)
    return out


def completion_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """TRL's completion-length metrics (tokens): all completions, and those that ended with EOS or a stop
    string ("terminated"; 0 when none did), and clipped_ratio, the share stopped by max_new_tokens."""
    lengths = [len(r.completion_ids) for r in rollouts]
    done = [len(r.completion_ids) for r in rollouts if not r.truncated]
    return {
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/min_length": float(min(lengths)),
        "completions/max_length": float(max(lengths)),
        "completions/mean_terminated_length": sum(done) / len(done) if done else 0.0,
        "completions/min_terminated_length": float(min(done, default=0)),
        "completions/max_terminated_length": float(max(done, default=0)),
        "completions/clipped_ratio": 1.0 - len(done) / len(lengths),
    }
