"""pass@k and mean@k from n sampled completions per prompt: the one definition behind `monorl eval` and the RL
loop's validation. A completion *passes* when its pass component is >= the threshold (validation.pass_component /
validation.pass_threshold); mean@k is the share of passing completions, averaged over prompts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import comb


def passes(rewards: Mapping[str, float | None], component: str, threshold: float) -> bool:
    """Whether a completion with these reward components passes (a component that does not apply: no)."""
    v = rewards.get(component)
    return v is not None and v >= threshold


def pass_component_of(components: Sequence[str], name: str | None) -> str:
    """The component that decides a pass: `name`, default the task's first; a name the task lacks is an error."""
    if name is None:
        if not components:
            raise ValueError("the task has no reward components to decide a pass with")
        return components[0]
    if name not in components:
        raise ValueError(f"validation.pass_component {name!r} is not one of the task's reward components "
                         f"({', '.join(components)})")
    return name


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of P(at least one of k samples passes) from n samples of which c passed
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def mean_pass_at_k(passed: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over prompts; `passed[i]` holds whether each of prompt i's samples passed."""
    if not passed:
        return 0.0
    return sum(pass_at_k(len(p), sum(p), k) for p in passed) / len(passed)


def mean_at_k(rewards: Sequence[Sequence[float]]) -> float:
    """The value averaged over each prompt's samples, then over prompts: mean@k of pass indicators (0/1)."""
    if not rewards:
        return 0.0
    return sum(sum(r) / len(r) for r in rewards) / len(rewards)
