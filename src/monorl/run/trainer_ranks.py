"""The disaggregated placement's trainer ranks (`placement.generator_ranks G`: the first ranks train, the last G
generate, `run/generator_ranks.py`). A trainer rank holds the policy, sharded over the trainer ranks, and no
generator: its batches and validation results come from the generator ranks (`ReceivedRollouts`), and each update
goes to them by broadcast (`WeightBroadcast`), after every step, the last too."""

from __future__ import annotations

import time

from monorl.rl.ranks.weight_broadcast import WeightBroadcast
from monorl.rl.rollouts.received import ReceivedRollouts
from monorl.run.generator_ranks import check_disaggregated
from monorl.run.parts import (
    Parts,
    build_checkpoints,
    build_consumer,
    build_trainer,
    generator_builder,
    load_policy_part,
    open_run_dir,
    prepare_trainer_policy,
)
from monorl.run.trainer_steps import TrainerSteps


def build(p: Parts) -> None:
    """policy (sharded), trainer, consumer (publishing by broadcast), the generators' batches as the rollout source,
    run dir, checkpoints, and the weight broadcast (a collective of the whole job, before a generator sizes its KV
    cache)."""
    cfg, boot = p.cfg, p.boot
    check_disaggregated(p.spec, p.placement)
    load_policy_part(p)
    with boot.timed("generator_init_s"):  # the tensor-parallel groups are every rank's to create; no copy here
        generator_builder(p)
    t = time.perf_counter()
    ref_model = prepare_trainer_policy(p)
    p.trainer = trainer = build_trainer(p, ref_model)
    p.consumer = build_consumer(p, trainer, lambda model, version: p.weights.send_(version), routing_model=None)
    p.rollouts = ReceivedRollouts(p.placement, cfg.rollout.max_staleness, cfg.validation.every, cfg.steps,
                                  lambda: trainer.step_count, bool(p.spec.val_prompts))
    p.run_dir = open_run_dir(p)
    p.checkpoints = build_checkpoints(p, config_source=p.policy)
    boot.timings["trainer_init_s"] = time.perf_counter() - t
    p.weights = WeightBroadcast(p.placement, p.policy)


class TrainerRanks(TrainerSteps):
    """The trainer side's run; validation and the learning-signal stop are the generator ranks' (the generators
    validate, and would wait for weights a stopped trainer never sends)."""

    def begin(self) -> None:
        """Version 0 to the generators, which validate with it, then receive."""
        self.consumer.publish()
        self.rollouts.start(0)
