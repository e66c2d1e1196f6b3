"""Which process this is among the job's ranks, and the few collectives the RL loop needs between them.

torchrun (or `monorl train --nproc N`) sets RANK / WORLD_SIZE / LOCAL_RANK; `init_world` reads them and joins
the process group (NCCL on CUDA, gloo on CPU) with a collective timeout, so a dead rank ends the others with an
error instead of a hang. Without those variables it returns `SINGLE`: one process, no process group, and every
method below is the identity, so a single-process run computes exactly what it did before scale-out existed.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
Backend = Literal["auto", "nccl", "gloo"]


@dataclass
class DistributedSection:
    """Runs on several GPUs or nodes, launched by torchrun or `monorl train --nproc N` (docs/guides/several-gpus.md)."""

    timeout_s: float = 600.0  # collective timeout: a dead or stuck rank fails the others after this, never a hang
    backend: Backend = "auto"  # process group backend: auto is nccl on CUDA, gloo on CPU

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"distributed.timeout_s must be > 0, got {self.timeout_s}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"distributed.backend must be auto | nccl | gloo, got {self.backend!r}")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the rank's GPU on its node
    # the process group the collectives below run in: None is the whole job's; a sub-group (the trainer ranks of
    # a disaggregated run, `monorl.distributed.placement`) makes this World those ranks alone, rank and size in it
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs and writes the run directory."""
        return self.rank == 0

    def share(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """The contiguous slice [lo, hi) of n items (prompt groups, sequences) that `rank` (default: this one)
        owns; slices differ in length by at most one."""
        r = self.rank if rank is None else rank
        return n * r // self.size, n * (r + 1) // self.size

    def gather_lists(self, items: list[T]) -> list[T]:
        """Every rank's `items`, concatenated in rank order, on every rank (picklable objects)."""
        if self.size == 1:
            return items
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, items, group=self.group)
        return [x for p in parts for x in p]

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` (rank 0 of `group`) on every rank (picklable)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place: the sum (or max) of `t` over ranks."""
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return t

    def max_int(self, n: int) -> int:
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=collective_device())
        return int(self.all_reduce_(t, "max").item())

    def any_(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, true when it is true on any rank: for decisions every rank must take together."""
        if self.size == 1:
            return flags
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=collective_device())
        return tuple(bool(x) for x in self.all_reduce_(t, "max").tolist())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block, then the other ranks do (all at once): rank 0 compiles into the shared compile
        cache, the others then load from it instead of each paying the cold compile. For rank-local work only
        (a collective inside would wait for ranks still outside)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


SINGLE = World()
# one tensor gathered from every rank into one: torch 2.13 renamed all_gather_into_tensor (deprecated there); torch
# 2.11 has only the old name
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def collective_device() -> torch.device:
    """Where tensors of this process's collectives live: its GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_world(device: str = "auto", timeout_s: float = 600.0, backend: str = "auto") -> World:
    """Join torchrun's process group (or return SINGLE outside torchrun). `device` is the run's device setting:
    on CUDA each rank takes GPU LOCAL_RANK. timeout_s bounds every collective: a rank that died or hangs makes
    the others fail after it, naming the collective, rather than wait forever."""
    if not launched_by_torchrun():
        return SINGLE
    world = World(rank=int(os.environ["RANK"]), size=int(os.environ["WORLD_SIZE"]),
                  local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if world.size == 1:  # torchrun --nproc_per_node 1: the single-process run
        return SINGLE
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(world.local_rank)
        nccl_graph_defaults()
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if restart != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # a restarted job meets in the store of torchrun's agent, which still holds the failed attempt's
            # addresses under the same keys (seen as gloo's "connectFullMesh ... Connection refused"; cf.
            # pytorch#167288): this attempt's keys get a prefix of their own
            store = dist.PrefixStore(f"monorl/attempt_{restart}", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout))
            dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    if (dist.get_rank(), dist.get_world_size()) != (world.rank, world.size):
        raise RuntimeError("the process group disagrees with RANK / WORLD_SIZE")
    return world


def nccl_graph_defaults() -> None:
    """NCCL settings for collectives captured in CUDA graphs (FSDP trainer graphs, tensor-parallel decode graphs),
    set before NCCL starts unless the user set them. NCCL_GRAPH_REGISTER=0: by default NCCL registers a captured
    collective's buffers with its peers while the graph is captured, a handshake that makes every rank capture the
    same collectives at the same time; ranks whose packs differ in shape capture different graphs at different steps
    (`Trainer._match_capture_passes`), and a 2-rank run hung at its first such step with registration on
    (TorchTitan's graph-captured SimpleFSDP runs with it off too)."""
    os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")


def close_world(world: World) -> None:
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def quiet_unless_main(world: World) -> None:
    """Rank 0 alone prints and logs: the other ranks' stdout goes nowhere and their log records below ERROR are
    dropped (errors still reach stderr, tagged by torchrun with the rank)."""
    if world.is_main:
        return
    import logging
    import sys

    sys.stdout = open(os.devnull, "w")  # for the life of the process
    logging.getLogger("monorl").setLevel(logging.ERROR)
