"""The trainer consumer: a producer's scored groups -> group advantages -> one trainer step -> the new weights
published to the generator. Colocated (one process holds both), publishing is an in-place refresh of the
generator's copy (`sync_weights_`: its CUDA graphs stay valid), queued on the GPU behind the update. For a
mixture-of-experts model, each step first checks that both copies route the batch's tokens alike
(`moe/routing_mismatch`). Disaggregated (`placement.generator_ranks`), a trainer rank holds no generator: publishing
is a broadcast to the generator ranks (`WeightBroadcast.send_`), and the routing check is left out. The run hands
the consumer its publication (`publish(model, version)`: `CopyInPlace`, or the broadcast)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from monorl.distributed.weight_sync import sync_weights_
from monorl.generate.generator import Generator
from monorl.model.moe_routing import generator_trainer_routing
from monorl.rl.rollouts.producer import RolloutBatch
from monorl.rl.rollouts.rollout import assign_advantages
from monorl.train.trainer import Trainer

if TYPE_CHECKING:  # the section's owner composes it in config.py, which imports this package
    from monorl.rl.sections import RolloutSection

ROUTING_CHECK_SEQUENCES = 16  # sequences of a step whose routing is compared (a share: a sample is enough)


Publish = Callable[[torch.nn.Module, int], None]  # the trainer's model and its version -> the generators


class CopyInPlace:
    """Publication into a generator's copy in this process: in place (its CUDA graphs stay valid), with the version."""

    def __init__(self, generator: Generator) -> None:
        self.generator = generator

    def __call__(self, model: torch.nn.Module, version: int) -> None:
        sync_weights_(self.generator.model, model)
        self.generator.policy_version = version


class TrainerConsumer:
    def __init__(self, rollout: RolloutSection, loss_kind: str, trainer: Trainer, publish: Publish,
                 device: torch.device, routing_model: torch.nn.Module | None = None, task_weight: float = 1.0) -> None:
        """rollout: the rollout section (advantages, masking, temperature); loss_kind: trainer.loss.kind;
        routing_model: the generator's copy a mixture-of-experts step compares routing with (`routing_check`);
        task_weight: the task's advantage's weight beside a distillation teacher's (teacher.task_weight)."""
        self.rollout, self.loss_kind, self.trainer, self.device = rollout, loss_kind, trainer, device
        self.task_weight = task_weight
        self.publish_weights, self.routing_model = publish, routing_model

    @property
    def policy_version(self) -> int:
        """The version of the weights the trainer holds (and has published): its optimizer steps so far."""
        return self.trainer.step_count

    def publish(self) -> None:
        """The trainer's weights into the generator's copy, in place (its CUDA graphs stay valid), and their
        version (disaggregated: sent to the generator ranks)."""
        self.publish_weights(self.trainer.model, self.policy_version)

    def consume(self, batch: RolloutBatch, after_publish: Callable[[], None] | None = None
                ) -> tuple[dict[str, Any], dict[str, float]]:
        """Advantages, the trainer step and the weight publication for `batch`; `after_publish` runs right after the
        publication is queued, before the trainer's host sync (host work for the next step, e.g. its prompts'
        tokenization, while the GPU trains). Returns (the trainer's metrics, the step's train/sync seconds)."""
        ro = self.rollout
        t0 = time.perf_counter()
        moe = self.trainer.model.config.is_moe and self.routing_model is not None
        routing = self.routing_check(batch) if moe else {}
        assign_advantages(batch.groups, normalize_std=ro.advantage_std_norm and self.loss_kind != "dr_grpo",
                          kind=ro.advantage)
        if self.task_weight != 1.0:  # distillation: the teacher's per-token advantage is added in the trainer
            for r in (r for g in batch.groups for r in g):
                r.advantage *= self.task_weight
        sync = {"s": 0.0}

        def after_update() -> None:  # queued behind the update, before the trainer's host sync (`Trainer.step`)
            t = time.perf_counter()
            self.publish()
            sync["s"] = time.perf_counter() - t
            if after_publish is not None:
                after_publish()

        seqs = [r.train_sequence(ro.mask_truncated, group=gi) for gi, g in enumerate(batch.groups) for r in g]
        metrics = {**self.trainer.step(seqs, temperature=ro.temperature, after_update=after_update), **routing}
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        # sync_s: the host time of queuing the weight sync, which runs on the GPU within train_s
        return metrics, {"train_s": time.perf_counter() - t0 - sync["s"], "sync_s": sync["s"]}

    def routing_check(self, batch: RolloutBatch) -> dict[str, float]:
        """The share of tokens the generator's copy and the trainer's model route to different experts (any sparse
        layer), over the first `ROUTING_CHECK_SEQUENCES` sequences of the batch, before the update (both copies then
        hold the same weights). 0 by construction in batch-invariant mode; reported, not corrected, outside it.
        Every rank runs it (an FSDP forward is collective) on the same sequences (the batch is every rank's)."""
        seqs = [list(r.prompt_ids) + list(r.completion_ids) for g in batch.groups for r in g]
        assert self.routing_model is not None
        rm = generator_trainer_routing(self.routing_model, self.trainer.model, self.trainer.autocast_dtype,
                                       seqs[:ROUTING_CHECK_SEQUENCES])
        return {"moe/routing_mismatch": rm.share,
                "moe/routing_mismatch_layers": rm.layer_routings_different / max(rm.layer_routings, 1)}
