"""The RL loop with generators and trainers on their own ranks (`placement.generator_ranks G`,
`monorl.distributed.placement`): the last G ranks run `run_generator`, the others the loop of `run/grpo.py`, which
takes its batches from `ReceivedRollouts` instead of a producer of its own.

A generator rank holds the generator's copy (built from the loaded policy, which it then drops) and the prompt
stream; each step s it first takes the weight updates it must or can (the trainers' version >= s - K, K =
rollout.max_staleness, and any whose broadcast has begun), then produces step s's scored groups and sends them to
every trainer (`rollout_transfer`: generator 0 sends the whole step, which the producer's gather gave every
generator). A trainer rank receives those in a thread of its own into a bounded queue (K + 1 steps), takes them in
step order, trains and publishes the new weights (`WeightBroadcast.send_`, after every step, the last too: the
generators then validate with the final weights). So a generator runs at most K versions behind the trainers and
waits for nothing else; K = 0 is the on-policy loop with the two sides in lock-step.

What travels from the generators besides the batches: validation results (the generators validate: before the first
step with version 0, with version v when v is a multiple of validation.every, after the last step) and the
generator side's times. A checkpoint is the trainers' (DCP over the trainer group) and stores the stream position
the batches carry (`RolloutBatch.stream_end`); on resume every generator reads that position from the checkpoint
itself, and batches produced ahead of it are generated again, by the resumed weights. Decisions the whole job would
take together (save, stop) are the trainers' alone: the generators hold no state a checkpoint needs.

With in-flight updates (`rollout.inflight_updates`) a generator takes an update whose broadcast has begun between
decode chunks, keeping its KV cache; each token records the version that sampled it; and it makes its batches back
to back on one engine (`rollouts/continuous.py`, continuous batches, staleness bounded at admission). Where batches are
made one at a time even so (agent tasks, dynamic sampling, a tensor-parallel generator) several generator ranks
take each update together, their chunk boundaries in lock-step meanwhile (`InflightUpdates`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from monorl.assembly import RunSpec
from monorl.console import record_only
from monorl.distributed.placement import Placement
from monorl.rl.ranks.rollout_transfer import send_rollouts
from monorl.rl.ranks.weight_broadcast import WeightBroadcast
from monorl.rl.rollouts.continuous import ContinuousBatches, run_continuous, runs_continuous
from monorl.rl.rollouts.producer import RolloutBatch
from monorl.rl.rollouts.received import Message
from monorl.rl.rollouts.staleness import may_generate
from monorl.run.checkpoints.files import read_meta
from monorl.run.elastic import die_for_test
from monorl.run.parts import Parts, build_producer, generator_builder, join_run_dir, load_policy_part
from monorl.run.stopping import GracefulStop, interrupted_line
from monorl.run.summary import RunResult
from monorl.tasks.base import RewardError


def check_disaggregated(spec: RunSpec, placement: Placement) -> None:
    """Refuse, in one line, what a disaggregated run does not do (yet)."""
    if not placement.disaggregated:
        return
    g = len(placement.generators)
    if spec.warm_start_steps > 0:
        raise ValueError(f"warm_start.steps={spec.warm_start_steps} with placement.generator_ranks={g}: the warm "
                         "start draws from the prompt stream the generator ranks hold; --warm_start.steps 0")


class InflightUpdates:
    """The in-flight update hook of a generator rank (`rollout.inflight_updates`), called between decode chunks
    (engine steps for episodes) while its sequences are in flight. An update is a collective of every generator and
    trainer, so G > 1 generators take it together: at each call they agree (one all-reduce of two flags over the
    generators' gloo group, on the host) on whether any of them sees a publication begun and whether any still
    generates; one that has finished its share keeps agreeing (`drain`, before the gather they all join) until none
    generates. With G = 1 it is a host poll, no collective. So the generators' chunk boundaries run in lock-step
    while an update may come."""

    def __init__(self, weights: Any, placement: Placement, receive: Callable[[], None]) -> None:
        self.weights, self.receive = weights, receive
        self.group, self.size = placement.generator_host_group, len(placement.generators)

    def __call__(self) -> None:
        self._agree(generating=True)

    def drain(self) -> None:
        while self._agree(generating=False):
            pass

    def _agree(self, generating: bool) -> bool:
        """Take an update if one is begun (on any generator); whether any generator still generates."""
        if self.size == 1:
            if generating and self.weights.pending():
                self.receive()
            return False
        flags = torch.tensor([int(self.weights.pending()), int(generating)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        begun, anyone = flags.tolist()
        if begun:
            self.receive()
        return bool(anyone)


def weight_sum(model: torch.nn.Module) -> float:
    """The sum of every weight, accumulated in float64 (no float64 copy): a check that the generators hold the
    trainers' final weights (equal to the HF export's sum where the copy is fp32: CPU runs)."""
    return float(sum(p.detach().sum(dtype=torch.float64).item() for p in model.parameters()))


def build(p: Parts) -> None:
    """The generator's copy (built from the loaded policy, which it then drops), the producer, the run directory rank
    0 named, and the weight broadcast (a collective of the whole job)."""
    check_disaggregated(p.spec, p.placement)
    load_policy_part(p)
    with p.boot.timed("generator_init_s"):
        p.generator = generator = generator_builder(p)()
    p.producer = build_producer(p, generator, lambda: generator.policy_version)
    p.policy = None  # the trainers hold the policy
    p.run_dir = join_run_dir(p)
    p.weights = WeightBroadcast(p.placement, generator.model)


class GeneratorRanks:
    """Drives a generator rank's parts (`run_generator`)."""

    def __init__(self, parts: Parts, progress: bool = True) -> None:
        self.parts, self.progress = parts, progress
        self.cfg, self.spec, self.world, self.boot = parts.cfg, parts.spec, parts.world, parts.boot
        self.generator, self.producer, self.run_dir = parts.generator, parts.producer, parts.run_dir
        self.policy = self.trainer = self.consumer = self.rollouts = None

    def warm_up(self) -> None:
        self.boot.warm_up(self.spec, None, None, self.generator, self.producer.warm_up_samplers())

    def validate(self) -> Any:
        return self.producer.validate()

    def run(self) -> RunResult:
        try:
            return run_generator(self.parts, self.warm_up)
        except KeyboardInterrupt:
            line = interrupted_line(self.run_dir.path, None, self.cfg.steps, "")
            record_only(f"\nmonorl: {line}\n")
            raise KeyboardInterrupt(line) from None
        finally:
            self.producer.close()
            self.run_dir.close()


def run_generator(run: Parts, warm_up: Callable[[], None]) -> RunResult:
    """A generator rank's whole run (module docstring); the trainers' side is `run/trainer_steps.py`."""
    cfg, placement, weights, producer = run.cfg, run.placement, run.weights, run.producer
    gen, gw = run.generator, placement.generator_world
    assert weights is not None and producer is not None and gen is not None
    K, steps, every = cfg.rollout.max_staleness, cfg.steps, cfg.validation.every
    warm_up()
    run.world.barrier()  # the trainers' warm-up too: startup ends when the slowest rank is ready
    start, fresh = 0, run.resume_from is None
    if not fresh:  # the trainers restore the checkpoint; its step and stream position are in its meta.json
        meta = read_meta(run.resume_from)
        start = int(meta["step"])
        producer.restart_at(int(meta["data_position"]))
    to_validate: list[int] = []  # versions taken that validation.every asks to validate

    def receive() -> None:
        v = gen.policy_version = weights.receive_()
        if every > 0 and run.spec.val_prompts and v % every == 0 and start < v < steps:
            to_validate.append(v)

    def update_begun() -> bool:  # every generator alike: they take each update together
        return gw.any_(weights.pending())[0] if gw.size > 1 else weights.pending()

    def send(msg: Message) -> float:
        t = time.perf_counter()
        send_rollouts(placement, [msg] if gw.is_main else [])
        return time.perf_counter() - t

    def validate_taken() -> None:  # between batches, with the weights held then: the trainers wait for it
        while to_validate:
            to_validate.pop(0)
            send(Message("validation", validation=producer.validate(), version=gen.policy_version))

    def take_update() -> None:  # between batches
        receive()
        validate_taken()

    receive()  # the trainers' weights as the run starts (version `start`)
    pre = producer.validate() if fresh else None
    if pre is not None:
        send(Message("validation", validation=pre, version=gen.policy_version))

    def reward_failed(e: RewardError, step: int) -> RunResult:  # the trainers save what ran and stop the job
        send(Message("batch", reward_error=str(e), last=True))
        while weights.version < step:  # what the trainers publish until they reach this step
            take_update()
        return RunResult(run.run_dir.path, pre, None, startup=dict(run.startup))

    # SIGTERM / a first Ctrl-C: the trainers finish their step (its publication needs this rank), save and stop
    with GracefulStop():
        if cfg.rollout.inflight_updates and runs_continuous(producer):
            batches = ContinuousBatches(producer)

            def send_batch(batch: RolloutBatch, generate_s: float, idle_s: float) -> None:
                send(Message("batch", batch=batch, generate_s=generate_s, metrics={"time/producer_idle_s": idle_s}))
                die_for_test(run.world.rank, batch.step + 1)

            try:
                run_continuous(batches, placement, weights, K, start, steps, receive, send_batch,
                               lambda: bool(to_validate), validate_taken)
            except RewardError as e:
                return reward_failed(e, batches.taken - 1)
        else:
            # in flight, between decode chunks: an update's validation waits for the batch's end
            between_chunks = InflightUpdates(weights, placement, receive) if cfg.rollout.inflight_updates else None
            send_s = 0.0
            for step in range(start, steps):
                t = time.perf_counter()
                while not may_generate(step, weights.version, K) or update_begun():
                    take_update()
                waited = time.perf_counter() - t + send_s
                t = time.perf_counter()
                try:
                    batch = producer.produce(step, between_chunks)
                except RewardError as e:
                    return reward_failed(e, step)
                generate_s = time.perf_counter() - t
                send_s = send(Message("batch", batch=batch, generate_s=generate_s,
                                      metrics={"time/producer_idle_s": waited}))
                validate_taken()  # an update taken in flight
                die_for_test(run.world.rank, step + 1)
    while weights.version < steps:  # the final weights, to validate with
        take_update()
    post = producer.validate()
    send(Message("validation", validation=post, version=weights.version, last=True,
                 metrics={"generator/final_version": weights.version, "generator/weight_sum": weight_sum(gen.model)}))
    return RunResult(run.run_dir.path, pre, post, startup=dict(run.startup))
