"""Rollouts: prompts -> n completions each (generator) -> rewards -> group-normalised advantages."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from monorl.distributed.world import SINGLE, World
from monorl.generate.engine import Generator
from monorl.generate.sampling import SamplingParams
from monorl.rl.advantages import compute_advantages
from monorl.tasks.base import Prompt, Task, safe_score_batch
from monorl.tasks.rewards import soft_overlong_penalty
from monorl.train.packing import TrainSequence

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    prompt: Prompt
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    rewards: dict[str, float | None]  # each component as scored (None: not applicable to this completion)
    reward_error: str | None = None  # why the reward failed (then every component is 0.0)
    advantage: float = 0.0
    weights: Mapping[str, float] = field(default_factory=dict)  # of the components in `reward`; absent: 1.0

    @property
    def reward(self) -> float:
        """The weighted sum of the components that apply (TRL's rule: None adds nothing)."""
        return sum(self.weights.get(k, 1.0) * v for k, v in self.rewards.items() if v is not None)

    @property
    def truncated(self) -> bool:
        """Stopped by max_new_tokens, before an EOS or stop string."""
        return self.finish_reason == "length"

    def train_sequence(self, mask_truncated: bool = False, group: int | None = None) -> TrainSequence:
        """The trainer's view; `mask_truncated` gives a truncated completion zero loss weight; `group`: the index of
        its prompt group in the step (the trainer packs a group's prompt once)."""
        return TrainSequence(self.prompt_ids, self.completion_ids, self.logprobs, self.advantage,
                             masked=mask_truncated and self.truncated, group=group)


def encode_prompts(task: Task, tokenizer, prompts: Sequence[Prompt], max_len: int,
                   max_new_tokens: int) -> tuple[list[Prompt], list[list[int]]]:
    """Render and tokenize; a prompt that leaves no room for `max_new_tokens` is skipped with a warning."""
    kept, ids = [], []
    for p in prompts:
        toks = tokenizer.encode(task.render(p, tokenizer))
        if len(toks) + max_new_tokens > max_len:
            log.warning("skipping prompt of %d tokens: with max_new_tokens=%d it exceeds the context of %d tokens",
                        len(toks), max_new_tokens, max_len)
            continue
        kept.append(p)
        ids.append(toks)
    return kept, ids


def generate_rollouts(generator: Generator, tokenizer, task: Task, prompts: Sequence[Prompt],
                      sampling: SamplingParams, n: int, max_len: int, world: World = SINGLE,
                      encoded: tuple[list[Prompt], list[list[int]]] | None = None) -> list[list[Rollout]]:
    """[prompt][sample] rollouts with rewards (no advantages yet). On several ranks (`world`) each generates and
    scores its contiguous share of the prompt groups (a group never spans ranks), keyed by the group's index in
    the whole batch, so a group's completions do not depend on the rank count; every rank gets all groups back.
    encoded: `encode_prompts(task, tokenizer, prompts, max_len, sampling.max_new_tokens)`, when already at hand."""
    prompts, prompt_ids = encoded or encode_prompts(task, tokenizer, prompts, max_len, sampling.max_new_tokens)
    lo, hi = world.share(len(prompts))
    prompts, prompt_ids = prompts[lo:hi], prompt_ids[lo:hi]
    if not prompts:
        return world.gather_lists([])
    outs = generator.generate(prompt_ids, sampling, n=n, first_prompt_index=lo)
    texts = [[c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps]
             for comps in outs]
    # One reward call for the whole batch (`Task.score_batch`; its default scores each with `safe_reward`).
    scores = iter(safe_score_batch(task, [p for p, comps in zip(prompts, outs, strict=True) for _ in comps],
                                   [t for ts in texts for t in ts], [list(c.token_ids) for cs in outs for c in cs]))
    weights = dict(task.reward_weights)  # one dict, shared by the batch's rollouts
    groups = []
    for p, ids, comps, ts in zip(prompts, prompt_ids, outs, texts, strict=True):
        group = []
        for c, text in zip(comps, ts, strict=True):
            rewards, error = next(scores)
            group.append(Rollout(p, ids, list(c.token_ids), list(c.logprobs), c.finish_reason, text, rewards, error,
                                 weights=weights))
        groups.append(group)
    failed = [r.reward_error for g in groups for r in g if r.reward_error is not None]
    if failed:  # one line per call, not one per completion
        log.warning("task %r: reward failed on %d of %d completions, scored 0.0 (first: %s)", task.name,
                    len(failed), sum(map(len, groups)), failed[0])
    return world.gather_lists(groups)


def assign_advantages(groups: list[list[Rollout]], normalize_std: bool, kind: str = "grpo") -> None:
    """Set each rollout's advantage (`kind`: one of monorl.rl.advantages.ADVANTAGE_KINDS; `normalize_std`
    applies to "grpo")."""
    if not groups:
        return
    rewards = torch.tensor([[r.reward for r in g] for g in groups], dtype=torch.float32)
    adv = compute_advantages(rewards, group_size=rewards.shape[1], kind=kind, normalize_std=normalize_std)
    for g, a in zip(groups, adv.tolist(), strict=True):
        for r, v in zip(g, a, strict=True):
            r.advantage = v


OVERLONG = "overlong"  # the reward component rollout.overlong_buffer adds


def add_overlong_penalty(groups: list[list[Rollout]], max_new_tokens: int, buffer: int, factor: float) -> None:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13) as reward component
    `OVERLONG`, weighted by `factor`: 0 up to max_new_tokens - buffer completion tokens, then linear down to -1
    at max_new_tokens (`monorl.tasks.rewards.soft_overlong_penalty`). Any task's rollouts take it."""
    if not groups:
        return
    weights = {**groups[0][0].weights, OVERLONG: factor}
    for g in groups:
        for r in g:
            r.rewards[OVERLONG] = soft_overlong_penalty(len(r.completion_ids), max_new_tokens, buffer)
            r.weights = weights
