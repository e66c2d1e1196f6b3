"""Weight publication across processes (a disaggregated run, `monorl.distributed.placement`): after an optimizer
step the trainer ranks send the new weights to the generator ranks, which write them in place into their fused
inference copy, so its CUDA graphs stay valid. The result is bitwise what `sync_weights_` writes colocated.

What moves: each trainer sends its own FSDP2 shard (rows [t*c, (t+1)*c) of every parameter, c = ceil(rows / T):
FSDP2's Shard(0) layout), already cast to the destination's dtype (through the dtype FSDP2 gathers in, as the
colocated gather does), as a broadcast in its group {trainer t} + generators. Every generator thus receives each
weight once, in bf16, split over the T trainers' links, and the trainers exchange nothing: gathering on the trainer
side first and broadcasting from one trainer would add an all-gather of (T - 1) / T of the model to every trainer
and funnel every byte through one rank. The cast is elementwise, so casting a shard is casting the whole. A LoRA
projection merged into the generator's copy is the exception: W + scale * B @ A needs A whole and is computed as
`sync_weights_` computes it (the block gathered, the full product on every trainer, each sending its rows of it), so
its bits are the colocated ones. A frozen parameter (a LoRA run's base) never changes: it is sent in the first
publication only (`full`).

Messages: one per (unit, trainer), a unit being a decoder layer (`model.layers.i`) or one parameter outside the
layers (embeddings, final norm, LM head), in the trainers' parameter order. A message is a flat byte buffer of
its pieces (each 16-byte aligned, in its destination's dtype), received into one buffer and copied into the
destination rows. A tensor outside the layers larger than a layer's share (the embedding matrix, the LM head)
goes in row chunks of at most that. Peak extra memory, on either side: `buffer_bytes`, the largest message: one
trainer's share of one decoder layer in the destination's dtype (Qwen3-0.6B: 15.7M parameters, 31.5 MB in bf16,
over T trainers), allocated once; a sharded LoRA source also gathers one block at a time, as `sync_weights_` does.

A publication starts with a header [version, full] from trainer 0, on the host (the placement's gloo `announce`
group): the version (the trainer's step count) travels with the weights, and a generator can ask whether an
update has begun (`pending`, a poll that never blocks) between decode steps, taking it only then, or when it may
not run further ahead. Every generator takes part in every message, so generators receive each update together,
and a trainer's messages complete only once the generators take them (under gloo its `send_` returns then; under
NCCL its GPU stream waits there, so the trainer's next host sync does).

`WeightBroadcast(placement, model)` is built once on every rank of the job (a collective: the generators describe
their copy, the trainers their parameters, and each side checks the mapping; a mismatch is the same one-line
`ValueError` on every rank). Then trainers call `send_(version)` and generators `receive_()`, once per update.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from monorl.distributed.fsdp import fsdp_units, gathered_dtype, is_sharded, shard_rows, unsharded
from monorl.distributed.placement import Placement
from monorl.distributed.weight_sync import (
    Source,
    destination_lora,
    destination_views,
    source_shape,
    sources,
    strip_compile_prefix,
)
from monorl.distributed.world import collective_device
from monorl.model.lora import LoRALinear

ALIGN = 16  # bytes: each piece starts aligned, so a byte slice can be viewed as any dtype
_LAYER = re.compile(r"(model\.layers\.\d+)\.")


@dataclass(frozen=True)
class Entry:
    """One tensor a trainer publishes: a source parameter, or a LoRA projection's merged weight."""

    name: str  # the source's name (HF names; `destination_views` maps it)
    shape: tuple[int, ...]  # its full shape
    unit: str  # its message group: `model.layers.i`, or its own name outside the layers
    frozen: bool  # never written by the optimizer: sent by a full publication only


@dataclass(frozen=True)
class Piece:
    entry: int  # index into the manifest
    lo: int  # rows [lo, hi) of the entry
    hi: int
    offset: int  # bytes into the message


@dataclass(frozen=True)
class Message:
    unit: str
    trainer: int  # index among the trainers: the sender
    pieces: tuple[Piece, ...]
    nbytes: int


def unit_of(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(1) if m else name


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_messages(manifest: list[Entry], dtypes: list[torch.dtype], trainers: int, full: bool) -> list[Message]:
    """Every message of one publication, in send order (units in manifest order, then trainers); empty ones are
    left out on both sides alike. A non-full publication leaves the frozen entries out. A message is at most one
    trainer's share of the largest decoder layer: a larger tensor outside the layers (the embedding matrix, the
    LM head) goes in row chunks of that size, so memory is bounded by a layer, not by the vocabulary."""
    row_bytes = [math.prod(e.shape[1:]) * dtypes[i].itemsize for i, e in enumerate(manifest)]

    def share(idx: list[int], t: int) -> tuple[list[Piece], int]:
        pieces, off = [], 0
        for i in idx:
            lo, hi = shard_rows(manifest[i].shape[0], t, trainers)
            if hi > lo:
                pieces.append(Piece(i, lo, hi, off))
                off += _aligned((hi - lo) * row_bytes[i])
        return pieces, off

    every: dict[str, list[int]] = {}
    for i, e in enumerate(manifest):
        every.setdefault(e.unit, []).append(i)
    cap = max((share(idx, t)[1] for u, idx in every.items() if _LAYER.match(u + ".") for t in range(trainers)),
              default=0)
    out = []
    for unit, idx in every.items():
        idx = [i for i in idx if full or not manifest[i].frozen]
        for t in range(trainers):
            pieces, nbytes = share(idx, t)
            if nbytes <= cap or len(pieces) != 1:
                if nbytes:
                    out.append(Message(unit, t, tuple(pieces), nbytes))
                continue
            (p,) = pieces  # one tensor outside the layers: rows of at most `cap` bytes a message
            step = max(1, cap // row_bytes[p.entry])
            for lo in range(p.lo, p.hi, step):
                hi = min(p.hi, lo + step)
                out.append(Message(unit, t, (Piece(p.entry, lo, hi, 0),), _aligned((hi - lo) * row_bytes[p.entry])))
    return out


def _as(buf: Tensor, p: Piece, e: Entry, dtype: torch.dtype) -> Tensor:
    n = (p.hi - p.lo) * math.prod(e.shape[1:]) * dtype.itemsize
    return buf[p.offset:p.offset + n].view(dtype).view(p.hi - p.lo, *e.shape[1:])


class WeightBroadcast:
    """One trainer's or one generator's end of the weight publication (module docstring). `model`: on a trainer
    its policy (FSDP2-sharded over the trainer group, or whole where there is one trainer), on a generator its
    inference copy (fused, its own dtype). Build it on every rank at the same point, before the generator sizes
    its KV cache (the receive buffer is allocated here)."""

    def __init__(self, placement: Placement, model: nn.Module) -> None:
        if not placement.disaggregated:
            raise ValueError("weight broadcast: the placement is colocated (generator_ranks 0): use sync_weights_")
        self.placement, self.model = placement, model
        self.role = placement.role
        world = placement.world
        device = collective_device()
        # 1. the generators' copy, as `sources` needs it
        desc = destination_lora(model) if world.rank == placement.generators[0] else None
        box = [desc]
        dist.broadcast_object_list(box, src=placement.generators[0], device=device)
        dst_names, dst_lora = box[0]
        # 2. the trainers' manifest (each trainer computes and checks its own; trainer 0's travels)
        err, manifest = None, None
        if self.role == "trainer":
            try:
                self._sources = sources(model, dst_names, dst_lora)
                manifest = [Entry(n, tuple(source_shape(s)), unit_of(n),
                                  isinstance(s, Tensor) and not s.requires_grad) for n, s in self._sources]
                self._check_shards()
            except ValueError as e:
                err = str(e)
        got = world.gather_lists([(err, manifest)])
        _raise_first(got)
        self.manifest: list[Entry] = next(m for _, m in got if m is not None)
        # 3. the generators place it (the one mapping, `destination_views`) and say each entry's dtype
        err, dtypes = None, None
        if self.role == "generator":
            try:
                views = {n: v for n, v, _ in destination_views(model, {e.name: e.shape for e in self.manifest})}
                self._views = [views[e.name] for e in self.manifest]
                dtypes = [str(v.dtype) for v in self._views]
            except ValueError as e:
                err = str(e)
        got = world.gather_lists([(err, dtypes)])
        _raise_first(got)
        answers = [d for _, d in got if d is not None]
        if any(d != answers[0] for d in answers):
            raise ValueError("weight broadcast: the generator ranks' copies differ in dtype")
        self.dtypes = [getattr(torch, d.removeprefix("torch.")) for d in answers[0]]
        T = len(placement.trainers)
        self._plans = {full: plan_messages(self.manifest, self.dtypes, T, full) for full in (True, False)}
        mine = [m for m in self._plans[True]
                if self.role == "generator" or m.trainer == placement.trainer_index]
        self.buffer_bytes = max((m.nbytes for m in mine), default=0)
        self._buf = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=device)
        self._header = torch.zeros(2, dtype=torch.int64)  # on the host: the announce group is gloo
        self._announced: dist.Work | None = None  # a generator's posted header receive
        self._published = False  # the first publication is full
        self.version = -1  # the last version received (a generator)

    def publication_bytes(self, full: bool) -> int:
        """Bytes one publication moves to each generator (full: the frozen entries too)."""
        return sum(m.nbytes for m in self._plans[full])

    # ---- trainers --------------------------------------------------------------------------------------------
    def _check_shards(self) -> None:
        """A sharded source must be FSDP2's Shard(0) over exactly the trainers: `shard_rows` is then its layout."""
        if not is_sharded(self.model):
            return
        from torch.distributed.tensor import DTensor, Shard

        T, t = len(self.placement.trainers), self.placement.trainer_index
        for name, s in self._sources:
            if not isinstance(s, DTensor):
                continue
            if s.placements != (Shard(0),) or s.device_mesh.size() != T:
                raise ValueError(f"weight broadcast: {name} is sharded as {s.placements} over "
                                 f"{s.device_mesh.size()} ranks, not Shard(0) over the {T} trainers")
            lo, hi = shard_rows(s.shape[0], t, T)
            if s.to_local().shape[0] != hi - lo:
                raise ValueError(f"weight broadcast: trainer {t} holds {s.to_local().shape[0]} rows of {name}, "
                                 f"FSDP2's split gives it {hi - lo}")

    def _rows(self, s: Source, lo: int, hi: int) -> Tensor:
        """This trainer's rows [lo, hi) of a source: its local shard, a slice of a whole tensor, or of a merged
        LoRA weight (its block is gathered by then)."""
        if isinstance(s, LoRALinear):
            return s.merged_weight()[lo:hi]
        if hasattr(s, "to_local"):  # a DTensor (FSDP2): this trainer holds its `shard_rows` alone
            first, _ = shard_rows(s.shape[0], self.placement.trainer_index, len(self.placement.trainers))
            rows = s.to_local().detach()[lo - first:hi - first]
            # through the dtype FSDP2 gathers in, as `sync_weights_` copies (a no-op into a bf16 copy; an fp32
            # destination, a LoRA copy's adapters, gets the bf16 values the trainer's forward computes with)
            gathered = gathered_dtype(rows.device)
            return rows.to(gathered) if gathered is not None and rows.is_floating_point() else rows
        return s.detach()[lo:hi]

    @torch.no_grad()
    def send_(self, version: int, full: bool | None = None) -> None:
        """Publish the trainer's current weights as `version` (every trainer calls it; full: every entry, frozen
        ones too; default: on the first publication only)."""
        if self.role != "trainer":
            raise ValueError("weight broadcast: send_ is a trainer's, this rank generates")
        full = not self._published if full is None else full
        p, t = self.placement, self.placement.trainer_index
        if t == 0:
            self._header.copy_(torch.tensor([version, int(full)]))
            dist.broadcast(self._header, src=p.trainers[0], group=p.announce_group)
        gathered = self._units_to_gather()
        for unit, msgs in _by_unit(self._plans[full]).items():
            with unsharded(gathered[unit]) if unit in gathered else contextlib.nullcontext():
                for m in msgs:
                    if m.trainer != t:
                        continue
                    for pc in m.pieces:
                        _as(self._buf, pc, self.manifest[pc.entry], self.dtypes[pc.entry]).copy_(
                            self._rows(self._sources[pc.entry][1], pc.lo, pc.hi))
                    dist.broadcast(self._buf[:m.nbytes], src=p.trainers[t], group=p.weight_groups[t])
        self._published = True

    def _units_to_gather(self) -> dict[str, nn.Module]:
        """unit -> its FSDP unit, for the units whose LoRA merges need it gathered (every trainer alike: the
        gather is a collective of the trainer group)."""
        if not is_sharded(self.model):
            return {}
        merged = {self.manifest[i].unit for i, (_, s) in enumerate(self._sources) if isinstance(s, LoRALinear)}
        names = {id(m): strip_compile_prefix(n) for n, m in self.model.named_modules()}
        return {names[id(u)]: u for u in fsdp_units(self.model) if names[id(u)] in merged}

    # ---- generators ------------------------------------------------------------------------------------------
    def _announcement(self) -> dist.Work:
        if self.role != "generator":
            raise ValueError("weight broadcast: receiving is a generator's, this rank trains")
        if self._announced is None:  # post the next header's receive; it completes when trainer 0 sends it
            p = self.placement
            self._announced = dist.broadcast(self._header, src=p.trainers[0], group=p.announce_group, async_op=True)
        return self._announced

    def pending(self) -> bool:
        """Whether the trainers have begun a publication this generator has not received: a poll on the host that
        never blocks (between decode steps; then `receive_`)."""
        return self._announcement().is_completed()

    @torch.no_grad()
    def receive_(self) -> int:
        """Receive the next publication into the generator's copy, in place (waiting for it to begin if it has
        not); returns its version."""
        self._announcement().wait()
        self._announced = None
        p = self.placement
        version, full = (int(x) for x in self._header.tolist())
        for m in self._plans[bool(full)]:
            dist.broadcast(self._buf[:m.nbytes], src=p.trainers[m.trainer], group=p.weight_groups[m.trainer])
            for pc in m.pieces:
                self._views[pc.entry][pc.lo:pc.hi].copy_(
                    _as(self._buf, pc, self.manifest[pc.entry], self.dtypes[pc.entry]))
        self.version = version
        return version


def _by_unit(msgs: list[Message]) -> dict[str, list[Message]]:
    out: dict[str, list[Message]] = {}
    for m in msgs:
        out.setdefault(m.unit, []).append(m)
    return out


def _raise_first(got: list[tuple[str | None, object]]) -> None:
    if errs := [e for e, _ in got if e is not None]:
        raise ValueError(errs[0])
