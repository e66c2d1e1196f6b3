"""A trainer rank's rollout source in the disaggregated placement: each step's batch as the generator ranks made it
(`run/generator_ranks.py`), received in a thread of its own into a bounded queue (K + 1 steps, K =
rollout.max_staleness) and taken in step order; the generators' validation results come the same way."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from monorl.distributed.placement import Placement
from monorl.rl.ranks.rollout_transfer import recv_rollouts
from monorl.rl.rollouts.metrics import ValidationResult
from monorl.rl.rollouts.producer import RolloutBatch
from monorl.rl.rollouts.sources import TakenStep
from monorl.rl.rollouts.staleness import checked_staleness
from monorl.tasks.base import RewardError

T = TypeVar("T")


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

    def __init__(self, placement: Placement, max_staleness: int, validate_every: int, steps: int,
                 trainer_version: Callable[[], int], validates: bool) -> None:
        """validates: the run has held-out prompts (validate_every, validation.every, then asks the generators for
        results); trainer_version: the trainer's policy version."""
        self.placement, self.trainer_version, self.validates = placement, trainer_version, validates
        self.max_staleness, self.validate_every, self.steps = max_staleness, validate_every, steps
        self.queue: queue.Queue[Message | BaseException] = queue.Queue(maxsize=self.max_staleness + 1)
        self.stash: deque[Message] = deque()  # received, put aside while looking for another kind
        self.thread: threading.Thread | None = None
        self.consumed: int | None = None
        self.generator_state: dict[str, float] = {}  # the final weights the generators hold (the post message's)

    def start(self, step: int, data_position: int | None = None) -> None:
        """Start receiving (the generators begin at `step`, the run's first or a resumed run's; they read the resumed
        stream position from the checkpoint themselves)."""
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

    def final_metrics(self) -> dict[str, float]:
        return self.generator_state

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
        metrics = checked_staleness(batch, self.trainer_version(), self.max_staleness)
        trained = train(batch)
        self.consumed, self.next_take = batch.stream_end, step + 1
        if self.max_staleness > 0:
            ahead = self.queue.qsize() + sum(m.kind == "batch" for m in self.stash)
            metrics["async/buffer_depth"] = ahead
        metrics.update({"time/consumer_idle_s": idle, **msg.metrics})
        every, done = self.validate_every, step + 1
        if every > 0 and self.validates and done % every == 0 and done < self.steps:
            val = self._next("validation")
            assert val.validation is not None
            metrics.update({**val.validation.metrics("val/"), "val/policy_version": val.version})
        return TakenStep(batch, trained, metrics, msg.generate_s)
