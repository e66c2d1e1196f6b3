"""The rollout producer: training prompts -> completions -> scored groups, one step's batch at a time, each
group tagged with the policy version that generated it (`RolloutBatch.policy_version`). The trainer consumes
what it yields (`rl/consumer.py`); the on-policy loop runs the two in lock-step (version = the trainer's steps).

What happens here, in order: the step's prompts (tokenized ahead, during the previous step's training, when the
GPU is busy), one generation round -- or DAPO's dynamic sampling, more rounds until enough groups carry signal
-- the rewards (with what TRL's reward functions are told: `RewardContext`), the overlong penalty, and the stop
when the reward failed on every completion for several steps. Validation's groups come from here too."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from monorl.agent.metrics import EpisodeRecord, episode_metrics
from monorl.agent.task import AgentTask
from monorl.distributed.world import World
from monorl.generate.generator import Generator
from monorl.generate.sampling import SamplingParams
from monorl.rl.rollouts.dynamic_sampling import SampledBatch, fill_batch, sampling_metric
from monorl.rl.rollouts.episodes import EpisodeRunner, generate_episodes
from monorl.rl.rollouts.metrics import ValidationResult, summarize
from monorl.rl.rollouts.rollout import (
    GenerationInputs,
    Rollout,
    add_overlong_penalty,
    encode_prompts,
    generate_rollouts,
    generation_inputs,
)
from monorl.rl.rollouts.sampling import RolloutSpec, rollout_sampling, validation_sampling
from monorl.tasks.base import Prompt, RewardError
from monorl.tasks.reward_context import RewardContext
from monorl.tasks.stream import PromptStream

log = logging.getLogger("monorl")


@dataclass
class RolloutBatch:
    """One step's scored groups (no advantages yet) and how they were made."""

    step: int
    sampled: SampledBatch  # the groups, and dynamic sampling's rounds
    context: RewardContext  # what the rewards logged (log_metric means go into the step's metrics)
    policy_version: int  # the generator's weights' version when it began (each sample records its own)
    metrics: dict[str, Any] = field(default_factory=dict)  # the episodes' (turns, tool calls and failures, ...)
    # the prompt stream's position after this batch drew its prompts: once the trainer has consumed the batch, the
    # first prompt not consumed (what a checkpoint stores; batches produced ahead are generated again on resume)
    stream_end: int = 0

    @property
    def groups(self) -> list[list[Rollout]]:
        return self.sampled.groups


class RolloutProducer:
    def __init__(self, spec: RolloutSpec, generator: Generator, world: World, policy_version: Callable[[], int],
                 stream: PromptStream | None = None) -> None:
        """policy_version: the version of the generator's weights now (the trainer's step count: weights are
        published after every trainer step)."""
        self.spec, self.cfg, self.generator, self.world = spec, spec.cfg, generator, world
        self.policy_version = policy_version
        self.stream = stream or PromptStream(spec.task, spec.cfg.seed)  # knows its position, for checkpoints
        # what dynamic sampling's filter reads (default: the pass component, as DAPO filters on accuracy)
        self.metric = sampling_metric(self.cfg.rollout.dynamic_sampling_metric, spec.components, spec.pass_component)
        # (max_new_tokens, prompts, their generation inputs) of the next step's first prompts (`encode_ahead`)
        self.encoded_ahead: tuple[int, list[Prompt], GenerationInputs] | None = None
        # the held-out prompts rendered and tokenized by the first validation: every later one reuses them (the
        # prompts and validation's sampler are the run's own, fixed; their images are made again each time: 200
        # prompts' patches would keep ~1 GB of host memory)
        self.val_encoded: tuple[list[Prompt], list[list[int]]] | None = None
        self.reward_failed_steps = 0  # consecutive steps whose reward failed on every completion
        self.warned_short_batch = False
        # an agent task's prompts are played as multi-turn episodes (`rl/rollouts/episodes.py`)
        self.episodes = (EpisodeRunner(generator, spec.tokenizer, spec.task, spec.max_len,
                                       max_tool_images=spec.cfg.rollout.max_tool_images)
                         if isinstance(spec.task, AgentTask) else None)
        self.records: list[EpisodeRecord] = []  # the step's episodes so far (over dynamic sampling's rounds)

    def close(self) -> None:
        """Let the episodes' worker threads go (an agent task's tool and environment calls)."""
        if self.episodes is not None:
            self.episodes.close()

    def restart_at(self, position: int) -> None:
        """Continue the prompt stream from `position` (a resumed run's data position)."""
        self.stream = PromptStream(self.spec.task, self.cfg.seed, start=position)
        self.encoded_ahead = None

    def reward_context(self) -> RewardContext:
        """What the task's rewards are told now (TRL's trainer_state: trainer steps done, the run's steps, prompts
        drawn) and where their log_metric / log_extra go."""
        return RewardContext(self.policy_version(), self.cfg.steps, self.stream.position)

    def produce(self, step: int, between_chunks: Callable[[], None] | None = None) -> RolloutBatch:
        """Step `step`'s batch: prompts_per_step scored groups (fewer when dynamic sampling ran out of rounds).
        between_chunks: called between decode chunks (engine steps for episodes) while sequences are in flight;
        it may load new weights into the generator (an in-flight update)."""
        ro = self.cfg.rollout
        context = self.reward_context()  # the rewards' trainer_state, and what they log over the step's rounds
        version = self.policy_version()
        self.records = []
        sampled = fill_batch(lambda n, round_: self.rollouts(step, n, round_, context, between_chunks),
                             ro.prompts_per_step, ro.dynamic_sampling, ro.max_sampling_rounds, metric=self.metric)
        return self.batch_of(step, sampled, context, version)

    def batch_of(self, step: int, sampled: SampledBatch, context: RewardContext, version: int,
                 stream_end: int | None = None) -> RolloutBatch:
        """Step `step`'s batch of the scored groups `sampled` (the reward-failure stop checked), begun at weights
        `version`; stream_end: where its prompts end in the stream (default: the stream's position now)."""
        ro = self.cfg.rollout
        if ro.dynamic_sampling and len(sampled.groups) < ro.prompts_per_step and not self.warned_short_batch:
            self.warned_short_batch = True  # once: the step line says it every step
            log.warning("step %d: dynamic sampling found %d of %d groups with reward variance in %d rounds "
                        "(rollout.max_sampling_rounds); training on those", step + 1, len(sampled.groups),
                        ro.prompts_per_step, sampled.rounds)
        rollouts = [r for g in sampled.groups for r in g]
        if not rollouts:
            raise ValueError(f"step {step + 1}: every prompt was skipped: none fits generator.max_model_len="
                             f"{self.spec.max_len} with {ro.max_new_tokens} new tokens")
        self.check_rewards(rollouts)
        return RolloutBatch(step, sampled, context, version, metrics=episode_metrics(self.records),
                            stream_end=self.stream.position if stream_end is None else stream_end)

    def rollouts(self, step: int, n: int, round_: int = 0, context: RewardContext | None = None,
                 between_chunks: Callable[[], None] | None = None) -> list[list[Rollout]]:
        """The next `n` training prompts' groups, scored (with the overlong penalty when configured)."""
        ro = self.cfg.rollout
        prompts = list(itertools.islice(self.stream, n))
        sampling = rollout_sampling(self.cfg, step, round_)
        if self.episodes is not None:
            groups, records = generate_episodes(self.episodes, prompts, sampling, ro.group_size, self.world,
                                                between_steps=between_chunks)
            self.records += records
        else:
            groups = self._completions(prompts, sampling, context, between_chunks)
        self.penalize(groups)
        return groups

    def penalize(self, groups: list[list[Rollout]]) -> None:
        """DAPO's overlong penalty on the scored groups, when configured."""
        ro = self.cfg.rollout
        if ro.overlong_buffer > 0:
            add_overlong_penalty(groups, ro.max_new_tokens, ro.overlong_buffer, ro.overlong_penalty)

    def _completions(self, prompts: list[Prompt], sampling: SamplingParams, context: RewardContext | None,
                     between_chunks: Callable[[], None] | None = None) -> list[list[Rollout]]:
        """Single-turn groups: one completion per sample, scored (prompts encoded ahead when they were)."""
        spec = self.spec
        ahead, self.encoded_ahead = self.encoded_ahead, None
        inputs = None
        if ahead is not None and ahead[0] == sampling.max_new_tokens and len(ahead[1]) == len(prompts) and \
                all(a is b for a, b in zip(ahead[1], prompts, strict=True)):
            inputs = ahead[2]
        return generate_rollouts(self.generator, spec.tokenizer, spec.task, prompts, sampling,
                                 self.cfg.rollout.group_size, spec.max_len, self.world, inputs=inputs,
                                 context=context, between_chunks=between_chunks)

    def encode_ahead(self, step: int) -> None:
        """Render and tokenize the prompts step `step` will draw first (`PromptStream.peek`: the stream's position
        does not move), and make their images' patches, for `rollouts` to take instead of encoding them itself.
        Host work that would otherwise run with the GPU idle at the start of that step."""
        spec, ro = self.spec, self.cfg.rollout
        self.encoded_ahead = None
        if self.episodes is not None:  # an episode's prompt is its environment's first observation
            return
        try:
            prompts = self.stream.peek(ro.prompts_per_step)
            max_new = rollout_sampling(self.cfg, step).max_new_tokens
            encoded = encode_prompts(spec.task, spec.tokenizer, prompts, spec.max_len, max_new, images=True)
            self.encoded_ahead = (max_new, prompts, generation_inputs(self.generator, self.world, *encoded))
        except Exception:  # noqa: BLE001 - a prompt that fails to render fails where that step draws it, as before
            log.debug("encoding the next step's prompts ahead failed; that step encodes them itself", exc_info=True)

    def check_rewards(self, rollouts: list[Rollout], patience: int = 3) -> None:
        """Stop the run when the reward failed on every completion of `patience` consecutive steps: a reward
        that cannot score anything would otherwise train on all-zero rewards forever."""
        errors = [r.reward_error for r in rollouts if r.reward_error is not None]
        self.reward_failed_steps = self.reward_failed_steps + 1 if len(errors) == len(rollouts) else 0
        if self.reward_failed_steps >= patience:
            raise RewardError(f"task {self.spec.task.name!r}: the reward failed on every completion of {patience} "
                              f"steps in a row; stopping (last error: {errors[-1]})")

    def validate(self) -> ValidationResult:
        """The held-out prompts, validation.k completions each (`validation_sampling`: greedy for k = 1)."""
        spec, v = self.spec, self.cfg.validation
        if not spec.val_prompts:
            return summarize([], spec.task.reward_components)
        how = "greedy" if v.k == 1 else f"{v.k} samples each"
        print(f"validating: {len(spec.val_prompts)} held-out prompts, {how}", flush=True)
        if self.episodes is not None:
            groups, _ = generate_episodes(self.episodes, spec.val_prompts, validation_sampling(self.cfg), v.k,
                                          self.world)
            return summarize(groups, spec.task.reward_components, spec.pass_component, v.pass_threshold)
        sampling = validation_sampling(self.cfg)
        if self.val_encoded is None:
            self.val_encoded = encode_prompts(spec.task, spec.tokenizer, spec.val_prompts, spec.max_len,
                                              sampling.max_new_tokens, images=True)
        groups = generate_rollouts(self.generator, spec.tokenizer, spec.task, spec.val_prompts, sampling, v.k,
                                   spec.max_len, self.world, context=self.reward_context(),
                                   inputs=generation_inputs(self.generator, self.world, *self.val_encoded))
        return summarize(groups, spec.task.reward_components, spec.pass_component, v.pass_threshold)

    def warm_up_samplers(self) -> list[SamplingParams]:
        """Each sampler the run's generation uses (rollouts, greedy validation), for 4 tokens: what the start-up
        warm-up compiles and captures."""
        return [dataclasses.replace(sp, max_new_tokens=4)
                for sp in (rollout_sampling(self.cfg, 0), SamplingParams(max_new_tokens=4, temperature=0.0))]
