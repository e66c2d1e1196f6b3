"""A GRPO run, the public entry: `GRPORun(cfg).run()` (tests, benchmarks) and `train` (the CLI, one rank under
torchrun). The run is its parts built from the resolved config (`run/parts.py`, per placement:
`run/placements.py`), run by the placement's driver: colocated (`run/colocated.py`: the producer and the
trainer in lock-step, rollout.max_staleness 0, or the producer up to K batches ahead), or disaggregated trainer ranks
(`run/trainer_ranks.py`) and generator ranks (`run/generator_ranks.py`). The data flow of one step is
`TrainerSteps.step` (`run/trainer_steps.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from monorl.config import RunConfig
from monorl.console import best_effort
from monorl.distributed.world import World, close_world, init_world, quiet_unless_main
from monorl.run.elastic import restart_resume_path
from monorl.run.parts import Parts
from monorl.run.placements import build_parts, driver_for
from monorl.run.summary import RunResult


class GRPORun:
    """One rank's run: `parts` (policy, generator, trainer, producer, consumer, rollouts, checkpoints, run_dir, ...)
    and `driver` (its placement's); a part or a driver method reads as an attribute (`run.trainer`, `run.step(0)`)."""

    def __init__(self, cfg: RunConfig, progress: bool = True, resume: str | Path | None = None,
                 world: World | None = None) -> None:
        """world: this process among the run's ranks (default: torchrun's, joined here; one process outside
        torchrun). Several ranks shard the trainer (FSDP2) and split each step's prompt groups. `cfg` is the
        config as given; the run executes its resolved copy (`self.cfg`, `monorl.assembly.resolve_config`)."""
        self.parts: Parts = build_parts(cfg, resume, world)
        self.driver = driver_for(self.parts, progress)

    def __getattr__(self, name: str) -> Any:
        if name in ("parts", "driver"):  # not built (a failed __init__)
            raise AttributeError(name)
        for owner in (self.driver, self.parts):
            if hasattr(owner, name):
                return getattr(owner, name)
        raise AttributeError(f"{type(self).__name__} has no part or driver attribute {name!r}")

    def run(self) -> RunResult:
        return self.driver.run()


def train(cfg: RunConfig, progress: bool = True, resume: str | Path | None = None) -> RunResult:
    """Run GRPO; `resume` (a run dir or one of its checkpoints) continues a stopped run. Under torchrun, one rank of
    the run: rank 0 alone prints and writes the run directory; a restarted job resumes its last checkpoint."""
    world = init_world(cfg.device, cfg.distributed.timeout_s, cfg.distributed.backend)
    quiet_unless_main(world)
    resume, run = restart_resume_path(cfg, world.is_main) if resume is None else resume, None
    try:
        with best_effort():  # a closed console (`| head`, a dead `| tee`) never ends the run: console.log keeps it
            run = GRPORun(cfg, progress and world.is_main, resume=resume, world=world)
            return run.run()
    finally:
        if world.size > 1:  # NCCL kernels in graphs (TP generator, FSDP trainer): dropped before the groups
            for part in filter(None, (getattr(run, "generator", None), getattr(run, "trainer", None))):
                part.release_graphs()
        close_world(world)
