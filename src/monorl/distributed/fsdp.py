"""FSDP2 on the trainer's policy: each transformer block is one unit and the root (embeddings, final norm,
LM head) another, so a forward or backward holds at most one block's full parameters beyond the root's.

fp32 masters, gradients and AdamW state stay sharded across ranks. On CUDA the blocks compute in bf16 and
gradients are reduced in fp32 (`MixedPrecisionPolicy`); on CPU (gloo, the tests) everything is fp32.
Gradients are *summed* over ranks, not averaged: each rank's loss is already its share of the global step
loss (the trainer divides by step-wide counts), so the sum is the one-rank gradient.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

# torch.distributed.fsdp is imported when a model is sharded: with DTensor and sympy it costs ~1.5 s, which a
# one-process run (the trainer and weight sync import this module) never needs. Until it is imported, no module
# can be an FSDPModule.


def gathered_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype a sharded unit's parameters are gathered in (FSDP2's mixed-precision param_dtype; None: their
    own, fp32): what a forward computes with, and what a gathered weight sync copies from."""
    return torch.bfloat16 if device.type == "cuda" else None


def shard_model_(model: nn.Module, device: torch.device, group: Any = None) -> None:
    """Apply FSDP2 in place: every block of `model.model.layers`, then the root. Call before building the
    optimizer (it must see the sharded parameters). group: the ranks to shard over (default: every rank; a
    disaggregated run's trainer group, `monorl.distributed.placement`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if (gathered := gathered_dtype(device)) is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32)
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh

        kw["mesh"] = DeviceMesh.from_group(group, device.type)
    for block in model.model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    for unit in fsdp_units(model):  # a plain sum (see the module docstring); gloo has no pre-scaled sum
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def _fsdp_module_type() -> type | None:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def is_sharded(model: nn.Module) -> bool:
    cls = _fsdp_module_type()
    return cls is not None and isinstance(model, cls)


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The FSDP units of `model`, blocks first (in layer order), the root last; [] for a plain model."""
    cls = _fsdp_module_type()
    if cls is None:
        return []
    return [m for m in model.modules() if isinstance(m, cls) and m is not model] + (
        [model] if isinstance(model, cls) else [])


@contextlib.contextmanager
def unsharded(unit: FSDPModule) -> Iterator[None]:
    """The unit's own parameters gathered in full for the block (its children stay sharded)."""
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()


def shard_rows(rows: int, rank: int, ranks: int) -> tuple[int, int]:
    """Rows [lo, hi) of a `rows`-row tensor that rank `rank` of `ranks` holds under FSDP2 (torch.chunk's split: equal
    parts of ceil(rows / ranks), the last ones shorter or empty)."""
    c = -(-rows // ranks)
    lo = min(rows, rank * c)
    return lo, min(rows, lo + c)


# what one all-gather of `gather_into_` receives at most (a single larger parameter goes alone): the extra memory of
# a weight sync, where gathering unit by unit held the root's embedding and LM head at once
GATHER_BUCKET_BYTES = 256 << 20

Fill = Callable[[torch.Tensor], None]  # takes a gathered full tensor (read it before returning: its memory is reused)


def gather_into_(shards: Sequence[tuple[Any, Fill]], bucket_bytes: int | None = None) -> None:
    """Hand every FSDP2-sharded parameter's full tensor (`DTensor`s sharded Shard(0) over one 1-D mesh: every rank
    holds its `shard_rows`) to its `Fill`, in the dtype FSDP2 gathers in (`gathered_dtype`): what a forward
    computes with. The shards are cast and packed into buckets of ~`bucket_bytes` received (default
    `GATHER_BUCKET_BYTES`), one
    `all_gather_into_tensor` each, instead of one FSDP unit's `unshard` at a time: a weight sync of Qwen3-0.6B on 4
    ranks queued 29 unshard/reshard pairs (0.040 s of host time a step, 0.007 for one rank's plain copies). Every
    rank must pass the same parameters in the same order (their collectives pair up)."""
    import torch.distributed as dist

    if not shards:
        return
    bucket_bytes = bucket_bytes or GATHER_BUCKET_BYTES
    mesh = shards[0][0].device_mesh
    ranks, group = mesh.size(), mesh.get_group()
    bucket: list[tuple[Any, Fill]] = []
    size = 0
    for s, fill in shards:
        if s.device_mesh != mesh:
            raise ValueError("gather_into_: the parameters are sharded over different meshes")
        per_rank = -(-s.shape[0] // ranks) * (s.numel() // max(s.shape[0], 1))
        if bucket and (size + per_rank) * ranks * s.element_size() > bucket_bytes:
            _gather_bucket(bucket, ranks, group, dist)
            bucket, size = [], 0
        bucket.append((s, fill))
        size += per_rank
    _gather_bucket(bucket, ranks, group, dist)


def _gather_bucket(bucket: list[tuple[Any, Fill]], ranks: int, group: Any, dist: Any) -> None:
    first = bucket[0][0]
    dtype = gathered_dtype(first.device) or first.dtype
    per_rank = [-(-s.shape[0] // ranks) * (s.numel() // max(s.shape[0], 1)) for s, _ in bucket]
    send = torch.empty(sum(per_rank), dtype=dtype, device=first.device)
    offsets = [0]
    for n in per_rank[:-1]:
        offsets.append(offsets[-1] + n)
    locals_ = [s.to_local() for s, _ in bucket]
    # each rank's rows, cast to the gathered dtype, at its parameter's offset (a short last shard leaves padding)
    torch._foreach_copy_([send[o:o + t.numel()].view(t.shape) for o, t in zip(offsets, locals_, strict=True)], locals_)
    recv = torch.empty(ranks * send.numel(), dtype=dtype, device=send.device)
    dist.all_gather_into_tensor(recv, send, group=group)
    by_rank = recv.view(ranks, send.numel())
    for (s, fill), o, n in zip(bucket, offsets, per_rank, strict=True):
        rows, rest = s.shape[0], tuple(s.shape[1:])
        chunk = -(-rows // ranks)
        parts = by_rank[:, o:o + n].view(ranks, chunk, *rest)
        fill(parts.reshape(ranks * chunk, *rest)[:rows])
