"""Rollouts from the generator ranks to the trainer ranks of a disaggregated run (`monorl.distributed.placement`).

Each generator sends its share of a step's scored groups to every trainer as one pickled object
(`broadcast_object_list` in its group {generator g} + trainers, a gloo group: host objects stay off the GPUs'
NCCL streams, which the weight broadcasts use). A trainer receives every generator's share in generator order, so
it sees the whole step as the colocated loop's all-gather gives it, and packs its own share of it. Rollouts are
token ids, log-probs and scores: megabytes a step against the weights' gigabytes, so pickling is not where the
time goes; the objects keep every field (episodes' masks and per-token versions, reward components, texts for
the samples log) without a tensor schema to keep in step with them.

A send completes only when the trainers take it (gloo's broadcast root waits for its receivers), as a weight
publication completes only when the generators take it. Running ahead (staleness K > 0), a trainer receives in a
thread of its own into a bounded buffer of K + 1 steps; otherwise a generator sending step s + 1 and a trainer
publishing the update after step s would each wait for the other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from monorl.distributed.placement import Placement

_HOST = torch.device("cpu")


def send_rollouts(placement: Placement, items: list[Any]) -> None:
    """A generator's share of the step (picklable items) to every trainer."""
    if placement.role != "generator":
        raise ValueError(f"send_rollouts is a generator rank's, this one is {placement.role!r}")
    g = placement.generator_index
    dist.broadcast_object_list([items], src=placement.generators[g], group=placement.rollout_groups[g],
                               device=_HOST)


def recv_rollouts(placement: Placement) -> list[Any]:
    """Every generator's share of the step, concatenated in generator order (a trainer's call)."""
    if placement.role != "trainer":
        raise ValueError(f"recv_rollouts is a trainer rank's, this one is {placement.role!r}")
    out: list[Any] = []
    for src, group in zip(placement.generators, placement.rollout_groups, strict=True):
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=src, group=group, device=_HOST)
        out.extend(box[0])
    return out
