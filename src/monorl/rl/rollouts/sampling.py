"""The samplers of a run, from its rollout and validation sections: the one place `rollout.*` becomes a
`SamplingParams` (the rollouts', validation's and eval's), and what the rollout side reads of a run's decisions
(`RolloutSpec`, which `monorl.assembly.RunSpec` satisfies) without importing the config or the assembly above it."""

from __future__ import annotations

from typing import Any, Protocol

from monorl.generate.sampling import SamplingParams
from monorl.rl.sections import RolloutSection, ValidationSection
from monorl.tasks.base import Prompt, Task


class SamplingConfig(Protocol):
    """The parts of a run's config its samplers read (`monorl.config.RunConfig` has them)."""

    seed: int
    steps: int
    rollout: RolloutSection
    validation: ValidationSection


class RolloutSpec(Protocol):
    """What the rollout side reads of a run's decisions (`monorl.assembly.RunSpec` has them)."""

    cfg: SamplingConfig
    tokenizer: Any
    task: Task
    max_len: int  # the generator's context: prompt + completion must fit
    val_prompts: list[Prompt]
    components: tuple[str, ...]
    pass_component: str | None


def sampling_params(cfg: SamplingConfig, *, temperature: float | None = None, max_new_tokens: int | None = None,
                    seed: int | None = None) -> SamplingParams:
    """The one place `rollout.*` becomes a sampler: the rollouts' (defaults), validation's and eval's (another
    temperature: 0 is greedy, top-p / top-k off)."""
    r = cfg.rollout
    t = r.temperature if temperature is None else temperature
    return SamplingParams(max_new_tokens=max_new_tokens or r.max_new_tokens, temperature=t,
                          top_p=r.top_p if t > 0 else 1.0, top_k=r.top_k if t > 0 else 0, ignore_eos=r.ignore_eos,
                          seed=cfg.seed if seed is None else seed)


def rollout_sampling(cfg: SamplingConfig, step: int, round_: int = 0) -> SamplingParams:
    """The rollout sampler of a step's generation round (dynamic sampling's later rounds get seeds of their own,
    far from any step's)."""
    return sampling_params(cfg, seed=cfg.seed * 1_000_003 + step + round_ * 1_000_000_007)


def validation_sampling(cfg: SamplingConfig) -> SamplingParams:
    """Validation's sampler: greedy for validation.k = 1, else sampled as the rollouts are with one fixed seed (every
    validation of the run draws the same noise)."""
    v = cfg.validation
    max_new = v.max_new_tokens or cfg.rollout.max_new_tokens
    if v.k == 1:
        return sampling_params(cfg, temperature=0.0, max_new_tokens=max_new)
    return sampling_params(cfg, max_new_tokens=max_new, seed=cfg.seed * 1_000_003 - 1)
