"""Which ranks generate and which train: colocated (every rank does both, the default) or disaggregated
(`placement.generator_ranks G`: G ranks generate, the others train the FSDP2-sharded policy).

Disaggregated, the trainers are the first N - G ranks and the generators the last G. Rank 0 is then a trainer:
the rank that prints, writes the run directory, the DCP checkpoints and the HF export (all trainer state) is one
that holds that state, and a trainer's rank in the trainer group equals its rank in the job (so a trainer is
also rank 0 of every transfer group below: the broadcast's source, see `weight_broadcast`).

`Placement.build` creates the process groups on every rank, in one fixed order (torch requires every rank to
call `new_group` for every group, in the same order, members or not):

    trainers                  FSDP2's mesh and the trainer step's collectives (`trainer_world`)
    generators                the generators' own decisions (their share of the step's prompt groups)
    weights[t], t < T         {trainer t} + generators: trainer t broadcasts its shard of each update
    announce                  {trainer 0} + generators (gloo): each update's header, which a generator polls
                              on the host between decode steps without blocking
    rollouts[g], g < G        {generator g} + trainers (gloo): generator g sends its scored groups
                              (`rollout_transfer`)
    generators (gloo)         the generators' agreement at each decode chunk on taking an update in flight
                              (`run.generator_ranks.InflightUpdates`), on the host: no GPU sync per chunk

Colocated, no group is created: `trainer_world` and `generator_world` are the job's `World` itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed as dist

from monorl.distributed.world import World

Role = Literal["both", "trainer", "generator"]


@dataclass
class PlacementSection:
    """Where generation and training run (docs/guides/several-gpus.md)."""

    # 0: colocated, every rank generates and trains. G > 0: the last G ranks generate (bf16 copies with their CUDA
    # graphs), the others train (FSDP2) and broadcast each update to them
    generator_ranks: int = 0

    def __post_init__(self) -> None:
        g = self.generator_ranks
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ValueError(f"placement.generator_ranks must be an integer >= 0 (0: colocated), got {g!r}")

    @property
    def disaggregated(self) -> bool:
        return self.generator_ranks > 0


def check_placement(section: PlacementSection, world_size: int) -> None:
    """Refuse, in one line, a generator count this job cannot place (before any process group is made)."""
    g, n = section.generator_ranks, world_size
    if g == 0:
        return
    if n == 1:
        raise ValueError(f"placement.generator_ranks={g} needs several processes (torchrun, or --nproc > {g}): "
                         "one process generates and trains colocated (generator_ranks 0)")
    if g >= n:
        raise ValueError(f"placement.generator_ranks={g} leaves no trainer among {n} ranks: use at most {n - 1}")


def role_share(section: PlacementSection, ranks: int, rank: int) -> tuple[Role, int]:
    """(role, how many ranks have it) for `rank` of a `ranks`-rank job, without any process group (the memory
    plan's question: what one GPU of this rank holds)."""
    g = section.generator_ranks
    if not g:
        return "both", ranks
    return ("generator", g) if rank >= ranks - g else ("trainer", ranks - g)


@dataclass(frozen=True)
class Placement:
    world: World  # the whole job
    trainers: tuple[int, ...]  # world ranks, in order
    generators: tuple[int, ...]
    trainer_world: World  # this rank among the trainers (its group's collectives); meaningless on a generator
    generator_world: World  # this rank among the generators
    weight_groups: tuple[Any, ...] = field(default=(), repr=False)  # [t]: trainer t + the generators
    announce_group: Any = field(default=None, repr=False)  # trainer 0 + the generators, gloo
    rollout_groups: tuple[Any, ...] = field(default=(), repr=False)  # [g]: generator g + the trainers
    generator_host_group: Any = field(default=None, repr=False)  # the generators, gloo

    @property
    def disaggregated(self) -> bool:
        return bool(self.weight_groups)

    @property
    def role(self) -> Role:
        if not self.disaggregated:
            return "both"
        return "trainer" if self.world.rank in self.trainers else "generator"

    @property
    def role_world(self) -> World:
        """This rank among the ranks of its role (the trainers, colocated or not; or the generators)."""
        return self.generator_world if self.role == "generator" else self.trainer_world

    @property
    def trainer_index(self) -> int:
        """This trainer's index among the trainers (its world rank, the trainers being first)."""
        if self.world.rank not in self.trainers:
            raise ValueError(f"rank {self.world.rank} generates: it has no trainer index")
        return self.trainers.index(self.world.rank)

    @property
    def generator_index(self) -> int:
        if self.world.rank not in self.generators:
            raise ValueError(f"rank {self.world.rank} trains: it has no generator index")
        return self.generators.index(self.world.rank)

    @classmethod
    def build(cls, world: World, section: PlacementSection) -> Placement:
        """Assign the roles and create the groups (module docstring). Call on every rank, at the same point."""
        check_placement(section, world.size)
        everyone = tuple(range(world.size))
        if not section.disaggregated:
            return cls(world, everyone, everyone, world, world)
        n_train = world.size - section.generator_ranks
        trainers, generators = everyone[:n_train], everyone[n_train:]
        trainer_group = dist.new_group(list(trainers))
        generator_group = dist.new_group(list(generators))
        weight_groups = tuple(dist.new_group([t, *generators]) for t in trainers)
        # host objects: gloo, off the GPU's NCCL streams the weight broadcasts use
        announce_group = dist.new_group([trainers[0], *generators], backend="gloo")
        rollout_groups = tuple(dist.new_group([*trainers, g], backend="gloo") for g in generators)
        generator_host_group = dist.new_group(list(generators), backend="gloo")

        def sub_world(ranks: tuple[int, ...], group: Any) -> World:  # rank -1: not one of them
            rank = ranks.index(world.rank) if world.rank in ranks else -1
            return World(rank=rank, size=len(ranks), local_rank=world.local_rank, group=group)

        return cls(world, trainers, generators, sub_world(trainers, trainer_group),
                   sub_world(generators, generator_group), weight_groups, announce_group, rollout_groups,
                   generator_host_group)
