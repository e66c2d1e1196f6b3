"""FSDP2 on the trainer's policy: each transformer block is one unit and the root (embeddings, final norm,
LM head) another, so a forward or backward holds at most one block's full parameters beyond the root's.

fp32 masters, gradients and AdamW state stay sharded across ranks. On CUDA the blocks compute in bf16 and
gradients are reduced in fp32 (`MixedPrecisionPolicy`); on CPU (gloo, the tests) everything is fp32.
Gradients are *summed* over ranks, not averaged: each rank's loss is already its share of the global step
loss (the trainer divides by step-wide counts), so the sum is the one-rank gradient.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from monorl.speedups.private_apis import foreach_copy_

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


# what one all-gather of `gather_into_` receives at most: the weight sync's extra memory (plus 1/N of it sent), where
# gathering unit by unit held the root's embedding and LM head at once (2.5 GB for Qwen3-8B)
GATHER_BUCKET_BYTES = 256 << 20


def gather_into_(pairs: Sequence[tuple[Any, torch.Tensor]], bucket_bytes: int | None = None) -> None:
    """Copy every FSDP2-sharded parameter (a `DTensor` sharded Shard(0) over one 1-D mesh: each rank holds its
    `shard_rows`) whole into its destination (a contiguous tensor of its shape, any dtype), through the dtype FSDP2
    gathers in (`gathered_dtype`: what a forward computes with). The ranks' rows are cast and packed into buckets
    of at most `bucket_bytes` received (default `GATHER_BUCKET_BYTES`; a large parameter spans several, in row
    pieces), one all-gather each. Every rank must pass the same parameters in the same order (their collectives
    pair up). A caller that gathers the same pairs again keeps the `GatherPlan` instead."""
    GatherPlan(pairs, bucket_bytes)()


@dataclass
class _Bucket:
    """One all-gather of a `GatherPlan`: its pieces (source, rows [a, b) of every rank's chunk, elements a rank
    sends for it), and where each lands: an evenly split piece by one strided copy (`even`: piece index, the
    destination seen as ranks x elements), an uneven one row block by row block (`uneven`: piece index, rank,
    elements, destination rows)."""

    size: int  # elements a rank sends
    pieces: list[tuple[Any, int, int, int]] = field(default_factory=list)
    even: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    uneven: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)


class GatherPlan:
    """`gather_into_`'s buckets for one list of (source, destination) pairs, laid out once: a weight sync that
    runs every step spends its host time on the copies and the collectives, not on planning them (~300 pieces for
    Qwen3-0.6B). Holds the sources and destination views, not the sources' local shards: those are read at each
    call, so a shard FSDP2 re-lays out is still read where it is."""

    def __init__(self, pairs: Sequence[tuple[Any, torch.Tensor]], bucket_bytes: int | None = None) -> None:
        self.buckets: list[_Bucket] = []
        if not pairs:
            return
        mesh = pairs[0][0].device_mesh
        self.ranks, self.group = mesh.size(), mesh.get_group()
        self.dtype = gathered_dtype(pairs[0][0].device) or pairs[0][0].dtype
        self.device = pairs[0][1].device
        # elements a rank sends in one bucket
        cap = max(1, (bucket_bytes or GATHER_BUCKET_BYTES) // (self.ranks * self.dtype.itemsize))
        bucket = _Bucket(0)
        for s, d in pairs:
            if s.device_mesh != mesh or (gathered_dtype(s.device) or s.dtype) != self.dtype:
                raise ValueError("gather_into_: the parameters are sharded over different meshes or gathered in "
                                 "different dtypes")
            if tuple(d.shape) != tuple(s.shape) or not d.is_contiguous():
                raise ValueError(f"gather_into_: a destination of shape {tuple(d.shape)} for a {tuple(s.shape)} source")
            chunk, width = -(-s.shape[0] // self.ranks), math.prod(s.shape[1:])
            a = 0
            while a < chunk:
                if bucket.size and bucket.size + width > cap:
                    self.buckets.append(bucket)
                    bucket = _Bucket(0)
                b = min(chunk, a + max(1, (cap - bucket.size) // width))
                self._add(bucket, s, d, a, b, chunk, width)
                a = b
        if bucket.pieces:
            self.buckets.append(bucket)

    def _add(self, bucket: _Bucket, s: Any, d: torch.Tensor, a: int, b: int, chunk: int, width: int) -> None:
        i, rows, n = len(bucket.pieces), s.shape[0], (b - a) * width
        bucket.pieces.append((s, a, b, n))
        bucket.size += n
        if rows == self.ranks * chunk:  # even: rank r's rows r * chunk + [a, b), one strided view of them all
            bucket.even.append((i, d.view(self.ranks, chunk * width)[:, a * width:b * width]))
            return
        for r in range(self.ranks):  # FSDP2's uneven split, cut at the last row
            lo, hi = r * chunk + a, min(r * chunk + b, rows)
            if hi > lo:
                bucket.uneven.append((i, r, (hi - lo) * width, d[lo:hi].view(-1)))

    @torch.no_grad()
    def __call__(self) -> None:
        from monorl.distributed.world import all_gather_single

        for bucket in self.buckets:
            sizes = [n for *_, n in bucket.pieces]
            send = torch.empty(bucket.size, dtype=self.dtype, device=self.device)
            outs, ins = [], []
            for (s, a, b, _), out in zip(bucket.pieces, send.split(sizes), strict=True):
                local = s.to_local()[a:b]  # a short last shard holds fewer rows: the rest of its piece is padding
                if local.numel():
                    outs.append(out[:local.numel()])
                    ins.append(local.reshape(-1))
            if outs:  # (a rank may hold none of a bucket's rows: the end of an uneven split)
                foreach_copy_(outs, ins)  # cast to the gathered dtype as FSDP2's all-gather does
            recv = torch.empty(self.ranks * bucket.size, dtype=self.dtype, device=self.device)
            all_gather_single(recv, send, group=self.group)
            parts = recv.view(self.ranks, bucket.size).split(sizes, dim=1)
            if bucket.even:
                foreach_copy_([d for _, d in bucket.even], [parts[i] for i, _ in bucket.even])
            for i, r, n, d in bucket.uneven:
                d.copy_(parts[i][r, :n])
