"""The placements, each a module with its parts' `build` and its driver: the one place that asks which placement
a rank has (`Placement.role`: "both" colocated, "trainer" / "generator" disaggregated). Adding a placement is a
module of its own and a line here (docs/guides/how-to/add-a-placement.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from monorl.config import RunConfig
from monorl.distributed.world import World
from monorl.run import colocated, generator_ranks, trainer_ranks
from monorl.run.parts import Parts, start_parts


class PlacementKind(NamedTuple):
    build: Callable[[Parts], None]  # adds the parts this placement's ranks hold
    driver: Callable[[Parts, bool], Any]  # runs them: `.run() -> RunResult`


PLACEMENTS: dict[str, PlacementKind] = {
    "both": PlacementKind(colocated.build, colocated.Colocated),
    "trainer": PlacementKind(trainer_ranks.build, trainer_ranks.TrainerRanks),
    "generator": PlacementKind(generator_ranks.build, generator_ranks.GeneratorRanks),
}


def build_parts(cfg: RunConfig, resume: str | Path | None = None, world: World | None = None) -> Parts:
    """The parts this rank needs, from the config as given (the run holds its resolved copy, `Parts.cfg`)."""
    parts = start_parts(cfg, resume, world)
    PLACEMENTS[parts.placement.role].build(parts)
    return parts


def driver_for(parts: Parts, progress: bool = True) -> Any:
    """The driver that runs `parts` on this rank's placement."""
    return PLACEMENTS[parts.placement.role].driver(parts, progress)
