"""Continuous batches: a generator rank of the disaggregated placement with in-flight weight updates
(`placement.generator_ranks G`, `rollout.inflight_updates`) makes its batches back to back on one request-level engine
(`generate.engine.Engine`, every sample a one-turn request), instead of one `generate` call per batch.

Why: with long-tailed completion lengths a batch's last samples decode with few rows beside them, and a generator
that waits for the batch's end before beginning the next idles most of its GPU through that tail (the synchronous
loop's problem, moved to the generator). Here the next batches' samples take the slots the finished ones free, so
the decode step keeps its rows (PipelineRL's and AReaL's scheme).

Staleness stays bounded the same way: batch b's samples are admitted only while the generator holds weights of
version >= b - K (K = rollout.max_staleness), so every sample's oldest token is at most K versions behind the trainer
that takes batch b; a batch is sent once all its samples are done, in step order. New weights are taken between
decode chunks as soon as a publication begins, the sequences in flight keeping their KV cache (an in-flight update);
each token records the version that sampled it.

Several generators (G > 1): each takes its contiguous share of every batch's prompt groups (as `generate_rollouts`),
and they run in lock-step at chunk boundaries: one all-reduce on the host per chunk agrees whether a publication has
begun on any of them (they then receive it together: it is a collective) and which batches every one has finished
(those are then gathered to every generator and sent by the first).

Sampling: sample j of prompt i in a batch draws the noise `generate` would give it in that batch (its key is
(the step's seed, i, j)): with the weights unchanged the tokens are those of the batch-by-batch path. Validation
drains the engine first (no batch is admitted meanwhile), then runs as elsewhere.

Not continuous (batch by batch, as without in-flight updates): agent tasks (episodes, `episodes.py`), dynamic
sampling, a tensor-parallel generator.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from monorl.distributed.placement import Placement
from monorl.generate.engine import Engine
from monorl.generate.requests import Completion, completion_of
from monorl.generate.sampling import SamplingParams
from monorl.generate.tensor_parallel import generation_world
from monorl.rl.rollouts.dynamic_sampling import fill_batch
from monorl.rl.rollouts.producer import RolloutBatch, RolloutProducer
from monorl.rl.rollouts.rollout import encode_prompts, gather_groups, score_groups
from monorl.rl.rollouts.sampling import rollout_sampling
from monorl.rl.rollouts.staleness import may_generate
from monorl.tasks.base import Prompt
from monorl.tasks.reward_context import RewardContext

log = logging.getLogger("monorl")

# decode steps a chunk may run past a finished sample (its extra tokens dropped): without it a chunk ends at the
# nearest sample's end, which with hundreds of samples of different lengths is every step or two
OVERRUN = 16


def runs_continuous(producer: RolloutProducer) -> bool:
    """Whether a generator rank with in-flight updates makes continuous batches (the module docstring's cases); if
    not, it logs why, once."""
    why = [w for w, off in (("an agent task's episodes", producer.episodes is not None),
                            ("dynamic sampling", producer.cfg.rollout.dynamic_sampling),
                            ("a tensor-parallel generator", producer.generator.tp.size > 1)) if off]
    if why:
        log.info("rollout.inflight_updates: batches are made one at a time (%s), not continuously", ", ".join(why))
    return not why


@dataclass
class OpenBatch:
    """A batch admitted to the engine: this generator's share of its prompt groups and their finished samples."""

    step: int
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    first: int  # the index of prompts[0] among the batch's prompts (the sampling keys)
    n: int  # samples per prompt
    context: RewardContext
    version: int  # the weights' version when it was admitted
    stream_end: int  # the prompt stream's position after its prompts
    done: dict[tuple[int, int], Completion] = field(default_factory=dict)  # (prompt, sample) -> its completion

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.prompts) * self.n


class ContinuousBatches:
    """One generator rank's batches on one engine: `admit` a step's batch, `step` the engine, `take` the oldest
    finished batch (scored and gathered over the generators)."""

    def __init__(self, producer: RolloutProducer) -> None:
        self.producer, self.gen = producer, producer.generator
        self.engine = Engine(self.gen, max_tokens=producer.spec.max_len, overrun=OVERRUN)
        self.open: deque[OpenBatch] = deque()
        self.taken = 0  # batches taken so far

    @staticmethod
    def sample_sampling(prompt_ids: list[int], sample: int, sampling: SamplingParams) -> SamplingParams:
        """A sample's sampling parameters: the step's (a benchmark gives each sample a length of its own here)."""
        return sampling

    def admit(self, step: int) -> None:
        """Draw step `step`'s prompts from the stream and queue this generator's share of its samples."""
        p, spec = self.producer, self.producer.spec
        ro = p.cfg.rollout
        context = p.reward_context()
        sampling = rollout_sampling(p.cfg, step)
        prompts, ids = encode_prompts(spec.task, spec.tokenizer, list(itertools.islice(p.stream, ro.prompts_per_step)),
                                      spec.max_len, sampling.max_new_tokens)
        lo, hi = generation_world(p.world, self.gen.tp).share(len(prompts))
        batch = OpenBatch(step, prompts[lo:hi], ids[lo:hi], lo, ro.group_size, context, self.gen.policy_version,
                          p.stream.position)
        for i, pid in enumerate(batch.prompt_ids):
            for j in range(batch.n):
                self.engine.add((lo + i, j, step), pid, self.sample_sampling(pid, j, sampling), one_turn=True)
        self.open.append(batch)

    def step(self) -> None:
        """One engine step (admissions, one decode chunk); finished samples go to their batches."""
        for ev in self.engine.step():
            req = self.engine.finish(ev.request_id)
            i, j, step = ev.request_id
            batch = next(b for b in self.open if b.step == step)
            batch.done[(i - batch.first, j)] = completion_of(self.gen.tokenizer, req)

    def finished_upto(self) -> int:
        """The step after the last of the leading finished batches (the batches that can be taken, in order)."""
        upto = self.taken
        for b in self.open:
            if not b.finished:
                break
            upto = b.step + 1
        return upto

    def take(self) -> RolloutBatch:
        """The oldest batch, finished on every generator: scored here, gathered over the generators (a collective)."""
        b = self.open.popleft()
        assert b.finished, f"batch {b.step} taken unfinished"
        self.taken = b.step + 1
        p, spec = self.producer, self.producer.spec
        outs = [[b.done[(i, j)] for j in range(b.n)] for i in range(len(b.prompts))]
        call = b.context.fresh()
        groups = score_groups(spec.tokenizer, spec.task, b.prompts, b.prompt_ids, outs, call)
        groups = gather_groups(p.world, self.gen, groups, call, b.context)
        p.penalize(groups)
        sampled = fill_batch(lambda n, round_: groups, len(groups), dynamic=False, max_rounds=1)
        return p.batch_of(b.step, sampled, b.context, b.version, stream_end=b.stream_end)


def agree(placement: Placement, begun: bool, finished_upto: int) -> tuple[bool, int]:
    """Over the generators (G > 1; host all-reduce): whether any saw a publication begun, and the batches every
    one has finished."""
    if len(placement.generators) == 1:
        return begun, finished_upto
    flags = torch.tensor([int(begun), -finished_upto])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=placement.generator_host_group)
    return bool(flags[0].item()), -int(flags[1].item())


def run_continuous(batches: ContinuousBatches, placement: Placement, weights, max_staleness: int, start: int,
                   steps: int, receive: Callable[[], None], send: Callable[[RolloutBatch, float, float], None],
                   validation_due: Callable[[], bool], validate: Callable[[], None]) -> None:
    """Make and send batches start..steps-1 (the module docstring). receive: take the next publication (a
    collective of every generator and trainer); send(batch, generate_s, idle_s): a batch to the trainers (every
    generator calls it); validation_due / validate: a validation the versions received ask for, run with the
    engine empty (one still due when the last batch is sent runs before this returns)."""
    gen, engine = batches.gen, batches.engine
    next_admit = next_send = batches.taken = start  # a resumed run's first batch is `start`
    idle, t_batch = 0.0, time.perf_counter()
    while next_send < steps:
        due = validation_due()
        while not due and next_admit < steps and may_generate(next_admit, gen.policy_version, max_staleness):
            batches.admit(next_admit)
            next_admit += 1
        busy = engine.has_work()
        if busy:
            batches.step()
        begun, upto = agree(placement, weights.pending(), batches.finished_upto())
        if begun:
            receive()
        for _ in range(next_send, upto):
            batch = batches.take()
            now = time.perf_counter()
            send(batch, now - t_batch - idle, idle)
            idle, t_batch, next_send = 0.0, now, next_send + 1
        if busy or begun:
            continue
        if due and next_send == next_admit:  # the engine is empty: validate now
            validate()
            continue
        # nothing to decode or send: the next batch waits for weights the trainers have not published yet
        t = time.perf_counter()
        if len(placement.generators) == 1:
            receive()
        else:
            time.sleep(0.001)  # the others agree at their next chunk; a publication is received together
        idle += time.perf_counter() - t
    if validation_due():  # an update received while the last batch decoded: the trainers wait for its validation
        validate()
