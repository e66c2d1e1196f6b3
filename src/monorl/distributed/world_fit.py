"""Whether a run's work divides over its ranks: checked at start-up, by `--nproc` before it starts processes, and
by the memory plan, each failing in one line. Above `world.py` and `placement.py`, which it reads both."""

from __future__ import annotations

from typing import Any

from monorl.distributed.placement import check_placement
from monorl.distributed.world import World


def check_world(cfg: Any, world: World) -> None:
    """Refuse at startup, in one line, a rank count that does not divide the step's work: each rank generates
    and trains prompts_per_step / N prompt groups; a tensor-parallel generator's groups are made of the run's ranks."""
    tp = cfg.generator.tensor_parallel_size
    if tp < 1 or world.size % tp:
        raise ValueError(f"generator.tensor_parallel_size={tp} does not divide the run's {world.size} rank(s): a "
                         f"tensor-parallel generator is split over that many of its GPUs (--nproc a multiple of {tp})")
    placement = getattr(cfg, "placement", None)
    if placement is not None:
        check_placement(placement, world.size)
    if world.size == 1:
        return
    n = cfg.rollout.prompts_per_step
    if placement is not None and placement.disaggregated:
        # the generators split the step's prompt groups; the trainers its sequences, in shares that may differ by one
        # (as micro-batch counts may: `Trainer._my_micro_batches`)
        g = placement.generator_ranks
        if n % g:
            raise ValueError(f"rollout.prompts_per_step={n} does not divide over the {g} generator rank(s) of "
                             f"placement.generator_ranks={g}: use a multiple of {g}")
        if tp > 1:
            raise ValueError(f"generator.tensor_parallel_size={tp} with placement.generator_ranks={g}: a "
                             "disaggregated run's generators each hold a whole copy (tensor_parallel_size 1)")
        return
    if n % world.size:
        raise ValueError(f"rollout.prompts_per_step={n} does not divide over {world.size} ranks: use a multiple "
                         f"of {world.size} (each rank generates and trains an equal share of the prompt groups)")
