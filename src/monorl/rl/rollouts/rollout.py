"""Rollouts: prompts -> n completions each (generator) -> rewards -> group-normalised advantages."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from monorl.distributed.world import SINGLE, World
from monorl.generate.generator import Generator
from monorl.generate.requests import Completion
from monorl.generate.sampling import SamplingParams
from monorl.generate.tensor_parallel import gathered_once, generation_world
from monorl.model.image_processing import ImageProcessor
from monorl.model.vision_prompt import ImageInputs, encode_with_images
from monorl.rl.advantages import compute_advantages
from monorl.tasks.base import Prompt, Task, safe_score_batch
from monorl.tasks.images import check_no_images
from monorl.tasks.reward_context import RewardContext
from monorl.tasks.rewards import OVERLONG, soft_overlong_penalty
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
    extra: dict[str, Any] = field(default_factory=dict)  # what the reward logged for it (`log_extra`), by column
    # an episode's: 1 on sampled tokens, 0 on inserted ones (tool results, environment messages: context only)
    completion_mask: list[int] | None = None
    # the policy version (trainer steps behind the weights) that generated it: an episode's oldest sampled token's
    policy_version: int = 0
    # the version that sampled each completion token (-1 on an episode's inserted ones); None: all policy_version
    token_versions: list[int] | None = None
    # its images (placeholders expanded): the prompt's, then an episode's tools' (in its inserted tokens)
    images: ImageInputs | None = None

    @property
    def reward(self) -> float:
        """The weighted sum of the components that apply (TRL's rule: None adds nothing)."""
        return sum(self.weights.get(k, 1.0) * v for k, v in self.rewards.items() if v is not None)

    @property
    def scorable(self) -> bool:
        """Some component applies to it. An unscorable completion gets advantage 0 and is left out of its group's
        baseline and the reward metrics (TRL 1.16's rule)."""
        return any(v is not None for v in self.rewards.values())

    @property
    def truncated(self) -> bool:
        """Stopped by max_new_tokens, before an EOS or stop string."""
        return self.finish_reason == "length"

    def train_sequence(self, mask_truncated: bool = False, group: int | None = None) -> TrainSequence:
        """The trainer's view; `mask_truncated` gives a truncated completion zero loss weight; `group`: the index of
        its prompt group in the step (the trainer packs a group's prompt once)."""
        return TrainSequence(self.prompt_ids, self.completion_ids, self.logprobs, self.advantage,
                             masked=mask_truncated and self.truncated, group=group,
                             completion_mask=self.completion_mask, images=self.images)


def encode_prompts(task: Task, tokenizer, prompts: Sequence[Prompt], max_len: int,
                   max_new_tokens: int, images: bool = False) -> tuple[list[Prompt], list[list[int]]]:
    """Render and tokenize; a prompt that leaves no room for `max_new_tokens` is skipped with a warning. images:
    the caller feeds a prompt's images (`generate_rollouts` expands its placeholders); else a prompt with images
    stops the run in one line."""
    kept, ids = [], []
    for p in prompts:
        if not images:
            check_no_images(p)
        toks = tokenizer.encode(task.render(p, tokenizer))
        if len(toks) + max_new_tokens > max_len:
            log.warning("skipping prompt of %d tokens: with max_new_tokens=%d it exceeds the context of %d tokens",
                        len(toks), max_new_tokens, max_len)
            continue
        kept.append(p)
        ids.append(toks)
    return kept, ids


@dataclass
class GenerationInputs:
    """What one rank feeds the generator for a batch: its share of the kept prompts (the batch's prompts from index
    `first`), their tokens with image placeholders expanded, and their images (`prompt_images`)."""
    prompts: list[Prompt]
    ids: list[list[int]]
    images: list[ImageInputs | None]
    first: int


def generation_inputs(generator: Generator, world: World, prompts: Sequence[Prompt],
                      prompt_ids: Sequence[list[int]]) -> GenerationInputs:
    """This rank's `GenerationInputs` of `encode_prompts`' kept prompts and tokens: its share (a TP group's ranks:
    the same share), images decoded, resized and cut into patches (host work a producer runs ahead, while the GPU
    trains: `RolloutProducer.encode_ahead`)."""
    lo, hi = generation_world(world, generator.tp).share(len(prompts))
    ids, images = prompt_images(generator, prompts[lo:hi], prompt_ids[lo:hi])
    return GenerationInputs(list(prompts[lo:hi]), ids, images, lo)


def generate_rollouts(generator: Generator, tokenizer, task: Task, prompts: Sequence[Prompt],
                      sampling: SamplingParams, n: int, max_len: int, world: World = SINGLE,
                      inputs: GenerationInputs | None = None,
                      context: RewardContext | None = None,
                      between_chunks: Callable[[], None] | None = None) -> list[list[Rollout]]:
    """[prompt][sample] rollouts with rewards (no advantages yet), each with the policy versions that sampled it
    (`Generator.policy_version`; between_chunks: `Generator.generate`'s, for an in-flight weight update). On several
    ranks (`world`) each generates and scores its contiguous share of the prompt groups (a group never spans ranks),
    keyed by the group's index in the whole batch, so a group's completions do not depend on the rank count; every
    rank gets all groups back.
    inputs: `generation_inputs` of `prompts` for this rank, when already at hand (made ahead).
    context: the step's `RewardContext`, passed to the task's rewards; what they log with log_metric is added to
    it (every rank's), what they log with log_extra lands in each rollout's `extra`."""
    if inputs is None:
        inputs = generation_inputs(generator, world, *encode_prompts(task, tokenizer, prompts, max_len,
                                                                     sampling.max_new_tokens, images=True))
    prompts, prompt_ids, images = inputs.prompts, inputs.ids, inputs.images
    call = context.fresh() if context is not None else None  # this call's logs, merged over ranks below
    outs = generator.generate(prompt_ids, sampling, n=n, first_prompt_index=inputs.first,
                              between_chunks=between_chunks, images=images) if prompts else []
    drain_updates(between_chunks)
    groups = score_groups(tokenizer, task, prompts, prompt_ids, outs, call, images)
    return gather_groups(world, generator, groups, call, context)


def score_groups(tokenizer, task: Task, prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]],
                 outs: Sequence[Sequence[Completion]], call: RewardContext | None,
                 images: Sequence[ImageInputs | None] | None = None) -> list[list[Rollout]]:
    """[prompt][sample] rollouts of the completions `outs`, scored by one reward call for them all (what the rewards
    log goes into `call`, a `RewardContext.fresh()`); images: each prompt's, carried to its rollouts."""
    if not prompts:
        return []
    # reward functions see the text without special tokens, as TRL's do (`Completion.text`)
    texts = [[c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True)
              for c in comps] for comps in outs]
    # One reward call for the whole batch (`Task.score_batch`; its default scores each with `safe_reward`).
    flat_texts = [t for ts in texts for t in ts]
    scores = iter(safe_score_batch(task, [p for p, comps in zip(prompts, outs, strict=True) for _ in comps],
                                   flat_texts, [list(c.token_ids) for cs in outs for c in cs], context=call))
    extras = iter(call.take_columns(len(flat_texts)) if call is not None else [{}] * len(flat_texts))
    weights = dict(task.reward_weights)  # one dict, shared by the batch's rollouts
    groups: list[list[Rollout]] = []
    images = images or [None] * len(prompts)
    for p, ids, comps, ts, im in zip(prompts, prompt_ids, outs, texts, images, strict=True):
        group = []
        for c, text in zip(comps, ts, strict=True):
            rewards, error = next(scores)
            group.append(Rollout(p, ids, list(c.token_ids), list(c.logprobs), c.finish_reason, text, rewards,
                                 error, weights=weights, extra=next(extras),
                                 policy_version=min(c.versions or [0]), token_versions=c.versions, images=im))
        groups.append(group)
    failed = [r.reward_error for g in groups for r in g if r.reward_error is not None]
    if failed:  # one line per call, not one per completion
        log.warning("task %r: reward failed on %d of %d completions, scored 0.0 (first: %s)", task.name,
                    len(failed), sum(map(len, groups)), failed[0])
    if not any(r.scorable for g in groups for r in g):  # e.g. a judge that graded nothing: never silently
        logged = "; ".join(f"{k} {sum(v):g}" for k, v in (call.metrics if call is not None else {}).items())
        log.warning("task %r: no reward component applied to any of the %d completions (each returned None%s): "
                    "every advantage is 0, nothing of this batch trains", task.name, sum(map(len, groups)),
                    f"; the rewards logged {logged}" if logged else "")
    return groups


def prompt_images(generator: Generator, prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]]
                  ) -> tuple[list[list[int]], list[ImageInputs | None]]:
    """Each prompt's tokens with its images' placeholders expanded, and its `ImageInputs` (None: no images), by the
    generator's image processor (`Generator.image_processor`, else the tower's patch sizes with Qwen3-VL's
    defaults). ValueError (one line) for images and a model without a vision tower."""
    if not any(p.meta.get("images") for p in prompts):
        return list(prompt_ids), [None] * len(prompts)
    vision = generator.model.config.vision
    if vision is None:
        raise ValueError("a prompt holds images and the policy has no vision tower: use a vision-language model "
                         "(e.g. Qwen3-VL) or drop the image column")
    processor = generator.image_processor or ImageProcessor.for_model(vision)
    out_ids, out_images = [], []
    for p, ids in zip(prompts, prompt_ids, strict=True):
        if p.meta.get("images"):
            ids, im = encode_with_images(ids, p.meta["images"], vision, processor)
        else:
            im = None
        out_ids.append(ids)
        out_images.append(im)
    return out_ids, out_images


def gather_groups(world: World, generator: Generator, groups: list[list[Rollout]], call: RewardContext | None,
                  context: RewardContext | None) -> list[list[Rollout]]:
    """Every generating rank's share of the groups, in rank order, on every rank (one collective; a TP group's
    share once), what their rewards logged added to `context`."""
    parts = world.gather_lists(gathered_once([(groups, call.metrics if call is not None else {})],
                                             generator.tp))
    for _, metrics in parts:
        if context is not None:
            context.add_metrics(metrics)
    return [g for part, _ in parts for g in part]


def drain_updates(between_chunks: Callable[[], None] | None) -> None:
    """After this rank's share of a generation: an in-flight update hook that several generator ranks take in
    lock-step (`InflightUpdates`) keeps its part in their agreement until every one of them
    is done generating (before the gather they all join)."""
    drain = getattr(between_chunks, "drain", None)
    if drain is not None:
        drain()


def assign_advantages(groups: list[list[Rollout]], normalize_std: bool, kind: str = "grpo") -> None:
    """Set each rollout's advantage (`kind`: one of monorl.rl.advantages.ADVANTAGE_KINDS; `normalize_std`
    applies to "grpo"). An unscorable rollout enters as NaN: advantage 0, out of every baseline (TRL 1.16's
    rule, `monorl.rl.advantages`)."""
    if not groups:
        return
    rewards = torch.tensor([[r.reward if r.scorable else math.nan for r in g] for g in groups], dtype=torch.float32)
    adv = compute_advantages(rewards, group_size=rewards.shape[1], kind=kind, normalize_std=normalize_std)
    for g, a in zip(groups, adv.tolist(), strict=True):
        for r, v in zip(g, a, strict=True):
            r.advantage = v




def add_overlong_penalty(groups: list[list[Rollout]], max_new_tokens: int, buffer: int, factor: float) -> None:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13) as reward component
    `OVERLONG`, weighted by `factor`: 0 up to max_new_tokens - buffer completion tokens, then linear down to -1
    at max_new_tokens (`monorl.tasks.rewards.soft_overlong_penalty`). Any task's rollouts take it. It applies to
    every completion, so with it no completion is unscorable (as with TRL's soft overlong punishment among the
    reward functions)."""
    if not groups:
        return
    weights = {**groups[0][0].weights, OVERLONG: factor}
    for g in groups:
        for r in g:
            r.rewards[OVERLONG] = soft_overlong_penalty(len(r.completion_ids), max_new_tokens, buffer)
            r.weights = weights
