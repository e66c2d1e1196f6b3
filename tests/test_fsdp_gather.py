"""`monorl.distributed.fsdp.gather_into_` on 2 gloo ranks: FSDP2-sharded parameters of awkward shapes (fewer rows
than ranks, uneven splits, 1-D) land whole in their destinations, whatever the bucket size -- down to one row a
bucket, where a rank holds none of some buckets' rows."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

SHAPES = [(3, 4), (1, 5), (7,), (4, 2), (5, 3)]  # rows 3 and 5 split unevenly over 2 ranks, 1 row leaves rank 1 none
BUCKETS = [None, 64, 1]  # the default (one bucket); a few rows; a row each (below one row: one row anyway)


class Params(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES])


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from monorl.distributed.fsdp import gather_into_

    dist.init_process_group("gloo")
    model = Params()
    want = [p.detach().clone() for p in model.ps]
    fully_shard(model)
    got = {}
    for bucket in BUCKETS:
        dst = [torch.full(s, float("nan")) for s in SHAPES]
        gather_into_(list(zip(model.ps, dst, strict=True)), bucket)
        got[bucket] = dst
    torch.save({"want": want, "got": got}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("gather")
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("bucket", BUCKETS)
def test_every_rank_gets_every_parameter_whole(ranks: list[dict], bucket: int | None) -> None:
    for r in ranks:
        for got, want in zip(r["got"][bucket], r["want"], strict=True):
            assert torch.equal(got, want)
