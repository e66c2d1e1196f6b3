"""The trainer consumer: a producer's scored groups -> group advantages -> one trainer step -> the new weights
published to the generator. Colocated (one process holds both), publishing is an in-place refresh of the
generator's copy (`sync_weights_`: its CUDA graphs stay valid), queued on the GPU behind the update. For a
mixture-of-experts model, each step first checks that both copies route the batch's tokens alike
(`moe/routing_mismatch`). Disaggregated (`placement.generator_ranks`), a trainer rank holds no generator: publishing
is a broadcast to the generator ranks (`send`: `WeightBroadcast.send_`), and the routing check is left out."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from monorl.config import RunConfig
from monorl.distributed.weight_sync import sync_weights_
from monorl.generate.engine import Generator
from monorl.model.moe_routing import generator_trainer_routing
from monorl.rl.producer import RolloutBatch
from monorl.rl.rollouts import assign_advantages
from monorl.train.trainer import Trainer

ROUTING_CHECK_SEQUENCES = 16  # sequences of a step whose routing is compared (a share: a sample is enough)


class TrainerConsumer:
    def __init__(self, cfg: RunConfig, trainer: Trainer, generator: Generator | None, device: torch.device,
                 send: Callable[[int], None] | None = None) -> None:
        """generator: the copy published into in place (colocated), or None and `send(version)` publishes."""
        if (generator is None) == (send is None):
            raise ValueError("a trainer consumer publishes into a generator copy or through send, one of the two")
        self.cfg, self.trainer, self.generator, self.device, self.send = cfg, trainer, generator, device, send

    @property
    def policy_version(self) -> int:
        """The version of the weights the trainer holds (and has published): its optimizer steps so far."""
        return self.trainer.step_count

    def publish(self) -> None:
        """The trainer's weights into the generator's copy, in place (its CUDA graphs stay valid), and their
        version (disaggregated: sent to the generator ranks)."""
        if self.send is not None:
            self.send(self.policy_version)
            return
        assert self.generator is not None
        sync_weights_(self.generator.model, self.trainer.model)
        self.generator.policy_version = self.policy_version

    def consume(self, batch: RolloutBatch, after_publish: Callable[[], None] | None = None
                ) -> tuple[dict[str, Any], dict[str, float]]:
        """Advantages, the trainer step and the weight publication for `batch`; `after_publish` runs right after the
        publication is queued, before the trainer's host sync (host work for the next step, e.g. its prompts'
        tokenization, while the GPU trains). Returns (the trainer's metrics, the step's train/sync seconds)."""
        cfg, ro = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        routing = self.routing_check(batch) if self.trainer.model.config.is_moe and self.generator else {}
        assign_advantages(batch.groups, normalize_std=ro.advantage_std_norm and cfg.trainer.loss.kind != "dr_grpo",
                          kind=ro.advantage)
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
        assert self.generator is not None
        rm = generator_trainer_routing(self.generator.model, self.trainer.model, self.trainer.autocast_dtype,
                                       seqs[:ROUTING_CHECK_SEQUENCES])
        return {"moe/routing_mismatch": rm.share,
                "moe/routing_mismatch_layers": rm.layer_routings_different / max(rm.layer_routings, 1)}
