"""pass@k and mean@k from n sampled completions per prompt (kept apart so the RL loop's validation can share it)."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


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
    """mean@k: the reward averaged over each prompt's k samples, then over prompts."""
    if not rewards:
        return 0.0
    return sum(sum(r) / len(r) for r in rewards) / len(rewards)
