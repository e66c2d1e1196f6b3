"""The RL loop with generators and trainers on their own ranks (`placement.generator_ranks G`,
`monorl.rl.ranks.placement`): the last G ranks run `run_generator`, the others the loop of `rl/run/grpo.py`, which
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

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from monorl.assembly import RunSpec
from monorl.rl.ranks.placement import Placement
from monorl.rl.ranks.rollout_transfer import recv_rollouts, send_rollouts
from monorl.rl.rollouts.continuous import ContinuousBatches, run_continuous, runs_continuous
from monorl.rl.rollouts.producer import RolloutBatch
from monorl.rl.rollouts.sources import TakenStep, staleness_metrics
from monorl.rl.run.checkpoints.files import read_meta
from monorl.rl.run.elastic import die_for_test
from monorl.rl.run.stopping import GracefulStop
from monorl.rl.run.summary import RunResult, ValidationResult
from monorl.tasks.base import RewardError

if TYPE_CHECKING:
    from monorl.config import RunConfig
    from monorl.rl.run.grpo import GRPORun
    from monorl.train.trainer import Trainer

T = TypeVar("T")


def check_disaggregated(spec: RunSpec, placement: Placement) -> None:
    """Refuse, in one line, what a disaggregated run does not do (yet)."""
    if not placement.disaggregated:
        return
    g = len(placement.generators)
    if spec.warm_start_steps > 0:
        raise ValueError(f"warm_start.steps={spec.warm_start_steps} with placement.generator_ranks={g}: the warm "
                         "start draws from the prompt stream the generator ranks hold; --warm_start.steps 0")


@dataclass
class Message:
    """What a generator rank sends the trainers: a step's batch, or a validation result."""

    kind: str  # "batch" | "validation"
    batch: RolloutBatch | None = None
    validation: ValidationResult | None = None
    version: int = 0  # the generator's weights' version when it validated
    metrics: dict[str, float] = field(default_factory=dict)  # the generator side's times; the final weights' sum
    generate_s: float = 0.0
    last: bool = False  # the run's last message (the receiver thread ends with it)
    reward_error: str = ""  # instead of a batch: the reward failed for good (`RolloutProducer.check_rewards`)


class ReceivedRollouts:
    """A trainer rank's batches, received from the generator ranks: the interface of `AheadRollouts` (`start`,
    `step`, `consumed_position`), and the validations the generators ran (`validation`)."""

    def __init__(self, placement: Placement, cfg: RunConfig, trainer: Trainer, validates: bool) -> None:
        """validates: the run has held-out prompts (validation.every then asks the generators for results)."""
        self.placement, self.cfg, self.trainer, self.validates = placement, cfg, trainer, validates
        self.max_staleness = cfg.rollout.max_staleness
        self.queue: queue.Queue[Message | BaseException] = queue.Queue(maxsize=self.max_staleness + 1)
        self.stash: deque[Message] = deque()  # received, put aside while looking for another kind
        self.thread: threading.Thread | None = None
        self.consumed: int | None = None
        self.generator_state: dict[str, float] = {}  # the final weights the generators hold (the post message's)

    def start(self, step: int) -> None:
        """Start receiving (the generators begin at `step`, the run's first or a resumed run's)."""
        self.next_take = step
        self.thread = threading.Thread(target=self._receive, name="monorl-rollouts", daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        try:
            while True:
                (msg,) = recv_rollouts(self.placement)
                self.queue.put(msg)
                if msg.last or msg.reward_error:
                    return
        except BaseException as e:  # noqa: BLE001 - a dead generator: the trainer raises it where it waits
            self.queue.put(e)

    def close(self) -> None:
        """Let the receiver thread go: it has ended after the last message, or is a daemon blocked in a receive
        that fails when the job closes (a run that stopped early)."""
        if self.thread is not None and not self.thread.is_alive():
            self.thread.join()

    def _next(self, kind: str) -> Message:
        for msg in self.stash:
            if msg.kind == kind:
                self.stash.remove(msg)
                return msg
        while True:
            got = self.queue.get()
            if isinstance(got, BaseException):
                raise RuntimeError(f"rollouts from the generator ranks stopped: {type(got).__name__}: {got}") from got
            if got.kind == kind:
                return got
            self.stash.append(got)

    @property
    def consumed_position(self) -> int:
        """The stream position of the first prompt whose batch the trainer has not trained on (a checkpoint's)."""
        if self.consumed is None:
            raise RuntimeError("no batch trained on yet: a disaggregated run checkpoints after its steps")
        return self.consumed

    def validation(self) -> ValidationResult:
        """The generators' next validation result (before the first step, after the last)."""
        msg = self._next("validation")
        self.generator_state.update(msg.metrics)
        assert msg.validation is not None
        return msg.validation

    def step(self, step: int, train: Callable[[RolloutBatch], T]) -> TakenStep[T]:
        """Step `step`: its batch as the generators made it, then the trainer's step on it (`train`, which publishes
        the new weights). Metrics: staleness (max_staleness > 0), async/buffer_depth (steps received ahead),
        time/consumer_idle_s (this trainer waiting for the batch), the generator's time/producer_idle_s (waiting
        for weights and for the trainers to take its previous batch), and the generators' validation after this
        step when validation.every asks for one (val/..., made with the weights this step published)."""
        if step != self.next_take:
            raise RuntimeError(f"the trainer asked for step {step + 1}'s batch; the next is {self.next_take + 1}'s")
        t0 = time.perf_counter()
        msg = self._next("batch")
        idle = time.perf_counter() - t0
        if msg.reward_error:  # the loop keeps what ran (a checkpoint) and stops, as colocated
            raise RewardError(msg.reward_error)
        batch = msg.batch
        assert batch is not None
        if batch.step != step:
            raise RuntimeError(f"the generator ranks sent step {batch.step + 1}'s batch for step {step + 1}")
        metrics = staleness_metrics(batch, self.trainer.step_count) if self.max_staleness > 0 else {}
        if metrics and metrics["staleness/max"] > self.max_staleness:
            raise RuntimeError(f"step {step + 1} would train on samples {metrics['staleness/max']} policy versions "
                               f"old, more than rollout.max_staleness={self.max_staleness}")
        trained = train(batch)
        self.consumed, self.next_take = batch.stream_end, step + 1
        if self.max_staleness > 0:
            ahead = self.queue.qsize() + sum(m.kind == "batch" for m in self.stash)
            metrics["async/buffer_depth"] = ahead
        metrics.update({"time/consumer_idle_s": idle, **msg.metrics})
        every, done = self.cfg.validation.every, step + 1
        if every > 0 and self.validates and done % every == 0 and done < self.cfg.steps:
            val = self._next("validation")
            assert val.validation is not None
            metrics.update({**val.validation.metrics("val/"), "val/policy_version": val.version})
        return TakenStep(batch, trained, metrics, msg.generate_s)


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


def run_generator(run: GRPORun) -> RunResult:
    """A generator rank's whole run (module docstring); the trainers' side is `GRPORun._run`."""
    cfg, placement, weights, producer = run.cfg, run.placement, run.weights, run.producer
    gen, gw = run.generator, placement.generator_world
    assert weights is not None and producer is not None and gen is not None
    K, steps, every = cfg.rollout.max_staleness, cfg.steps, cfg.validation.every
    run.warm_up()
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
                while weights.version < step - K or update_begun():
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
