"""`RecycledWindowKV`: sliding-window layers' keys and values in a pool of their own, recycled (#57).

A window layer at position p reads keys p - W + 1 .. p only, so a sequence needs at most R = blocks_for(W) + 1 window
blocks at any time (W consecutive positions touch at most that many blocks). Each sequence holds a *ring* of R
blocks of the kind's own pool (`SequenceState.kind_state["window"]`), set and freed by `Cache`'s hooks: its table
index i (>= the ring's base) is served by ring[(i - base) % R]. Index i + R reuses index i's block, whose keys are
then out of every window (the first visible block of position p is at index >= p // bs - R + 1), so a turn's table
never changes while it decodes (CUDA graphs keep their static state) and no block is handed back mid-turn.

How the layers find their blocks without new context fields: `block_map[full_block]` (a device tensor, the
`RecurrentState.row_of_block` pattern) maps every block of the shared table to its window block; a window layer's
`layer_state` is a `WindowLayer`, which the contexts ask for their window view (`window_context`): tables and slots
mapped through `block_map`. A prefill writes only the positions the next query can see (end - W + 1 ..; the rest
to the scratch block 0), so no two of its tokens write one ring slot.

Prefix sharing: a prompt group's prompt is prefilled once into the group's ring (`prefix_allocated`); the members'
shared blocks keep mapping to it (held until the last member frees), their own blocks to their own rings.

Sizing: R window blocks per sequence row (`bytes_per_sequence`; rows: `sequence_rows(max_num_seqs)`, as the
recurrent kind's), `bytes_per_block` its map entry; `Cache.can_extend(blocks, rows)` asks for R free window
blocks per new row (preempting paused requests otherwise).

A resumed turn's cached prefill (`TurnWindow`): its new tokens would overwrite ring slots that its own earlier
queries still read, so they attend through a temporary copy of the kept keys; only then are they written to the
ring. A decode that ran past its stop may have overwritten kept keys: `keeps` frees the sequence (recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from monorl.generate.block_pool import BlockPool
from monorl.model.config import ModelConfig
from monorl.ops import sequence_of_rows
from monorl.ops.block_kernels import write_kv

KIND = "window"  # its key in SequenceState.kind_state


def ring_size(window: int, block_size: int) -> int:
    """R: the most blocks W consecutive positions touch."""
    return -(-window // block_size) + 1


@dataclass
class Ring:
    blocks: list[int]  # R window blocks
    base: int  # the table index ring[0] serves
    prefix: int | None = None  # the group prefix (its first full block) whose ring the shared blocks map to


class RecycledWindowKV:
    """The recycling cache kind of "sliding_attention" layers (the module docstring)."""

    traceable = False  # `_slots` / `ring_slots` map the step's slot mapping (a kernel's output in a trace pass)

    block_size = 0  # set before sizing (`cache._kinds`): a row holds R blocks

    def __init__(self, cfg: ModelConfig, layer_ids: list[int]) -> None:
        self.cfg, self.layer_ids = cfg, layer_ids
        self.window = cfg.sliding_window
        self.prefix_rings: dict[int, list[Any]] = {}  # a group's first block -> [its Ring, holders]
        self.kv: Tensor | None = None

    def _elem(self, dtype: torch.dtype) -> int:
        return torch.empty((), dtype=dtype).element_size()

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        self.block_size = block_size
        return 8  # its entry in `block_map`

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        c = self.cfg
        per_block = len(self.layer_ids) * 2 * self.block_size * c.num_kv_heads * c.head_dim * self._elem(dtype)
        return ring_size(self.window, self.block_size) * per_block

    def size_rows(self, rows: int | None) -> None:
        if rows is None:
            raise ValueError("a cache with recycled sliding-window layers needs max_num_seqs (its rings: "
                             "Cache(..., max_num_seqs=))")
        self.rows = rows

    def allocate(self, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        c = self.cfg
        self.block_size, self.R = block_size, ring_size(self.window, block_size)
        n = self.rows * self.R  # the scratch row's R blocks hold the scratch block 0
        self.kv = torch.zeros(len(self.layer_ids), 2, n, block_size, c.num_kv_heads, c.head_dim, device=device,
                              dtype=dtype)
        self.block_map = torch.zeros(num_blocks, dtype=torch.int64, device=device)
        self.pool = BlockPool(n)

    def allocated_bytes(self) -> int:
        assert self.kv is not None
        return self.kv.numel() * self.kv.element_size() + self.block_map.numel() * 8

    def layer_state(self, layer: int) -> WindowLayer:
        assert self.kv is not None
        return WindowLayer(self.kv[self.layer_ids.index(layer)], self.block_map, self.block_size, self.window)

    def copy_blocks(self, src: Tensor, dst: Tensor) -> None:
        assert self.kv is not None
        self.kv[:, :, self.block_map[dst]] = self.kv[:, :, self.block_map[src]]

    def held(self, state: Any) -> int:
        """Window blocks a sequence holds of its own (tests count them)."""
        ring = state.kind_state.get(KIND)
        return 0 if ring is None else len(ring.blocks)

    # ---- the `Cache` operations' hooks ------------------------------------------------------------------------
    def can_hold(self, new_rows: int) -> bool:
        return self.pool.can_allocate(new_rows * self.R)

    def _map(self, table: list[int], ring: Ring, start: int) -> None:
        idx = range(max(start, ring.base), len(table))
        if idx:
            dev = self.block_map.device
            self.block_map[torch.tensor([table[i] for i in idx], device=dev)] = torch.tensor(
                [ring.blocks[(i - ring.base) % self.R] for i in idx], device=dev)

    def shared(self, state: Any, blocks: list[int]) -> None:
        """A sequence starts with a group's shared prompt blocks (already mapped to the group's ring)."""
        ring = state.kind_state[KIND] = Ring(self.pool.allocate(self.R), base=len(state.table))
        if blocks:
            ring.prefix = blocks[0]
            self.prefix_rings[blocks[0]][1] += 1

    def extended(self, state: Any, blocks: list[int]) -> None:
        if KIND not in state.kind_state:
            state.kind_state[KIND] = Ring(self.pool.allocate(self.R), base=0)
        self._map(state.table, state.kind_state[KIND], len(state.table) - len(blocks))

    def freed(self, state: Any) -> None:
        if (ring := state.kind_state.pop(KIND, None)) is not None:
            self.pool.release(ring.blocks)
            if ring.prefix is not None:
                self._unhold(ring.prefix)

    def keeps(self, state: Any, positions: int) -> bool:
        """Whether the ring still holds the last W - 1 keys before `positions` (a paused turn's next queries read
        them). A decode that ran past its stop may have written up to the table's end, each write overwriting the
        index R back; when that could reach those keys the sequence is freed, to be recomputed."""
        ring = state.kind_state.get(KIND)
        return ring is None or len(state.table) - 1 - self.R < (positions - self.window + 1) // self.block_size

    def prefix_allocated(self, blocks: list[int]) -> None:
        ring = Ring(self.pool.allocate(self.R), base=0)
        self.prefix_rings[blocks[0]] = [ring, 1]
        self._map(blocks, ring, 0)

    def prefix_released(self, blocks: list[int]) -> None:
        self._unhold(blocks[0])

    def _unhold(self, key: int) -> None:
        entry = self.prefix_rings[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.pool.release(entry[0].blocks)
            del self.prefix_rings[key]


class WindowLayer:
    """One window layer's state: its keys and values and the map from the shared table's blocks to its own."""

    def __init__(self, kv: Tensor, block_map: Tensor, block_size: int, window: int) -> None:
        self.kv, self.block_map, self.block_size, self.window = kv, block_map, block_size, window

    def _slots(self, slots: Tensor) -> Tensor:
        bs = self.block_size
        return self.block_map[slots // bs] * bs + slots % bs

    def window_context(self, ctx: Any) -> Any:
        """`ctx` with this layer's blocks: tables and slots mapped through `block_map` (a turn: `TurnWindow`)."""
        name = type(ctx).__name__
        if name == "CachedPrefillContext":
            lens_q, lens_k = ctx.cu_seqlens_q.diff().long(), ctx.cu_seqlens_k.diff().long()
            return TurnWindow(self, ctx, ctx.seq_index, ctx.positions, lens_k - lens_q, lens_k, ctx.block_tables)
        if name == "DecodeContext" and ctx.cu_seqlens is not None:  # a turn's decode rows (batch-invariant)
            cu, pos = ctx.cu_seqlens.long(), ctx.seq_lens.long() - 1
            T, S = pos.numel(), cu.numel() - 1
            seq = sequence_of_rows(cu, torch.arange(T, device=cu.device)).clamp(max=S - 1)
            lens_q = cu.diff()
            end = torch.where(lens_q > 0, pos[(cu[1:] - 1).clamp(min=0)] + 1, 0)
            tables = ctx.block_tables[cu[:-1].clamp(max=T - 1)]
            return TurnWindow(self, ctx, seq, pos, end - lens_q, end, tables)
        if name == "DecodeContext":
            return self._decode_view(ctx)
        if name == "PrefillContext":
            v = ctx.varlen
            cu = v.cu_seqlens.long()
            T = ctx.slot_mapping.numel()
            seq = sequence_of_rows(cu, torch.arange(T, device=cu.device)).clamp(max=cu.numel() - 2)
            end = (cu[1:] - cu[:-1])[seq]
            return replace(ctx, slot_mapping=self.ring_slots(ctx.slot_mapping, v.positions[:T], end))
        raise NotImplementedError(f"recycled window layers: no window view of a {name}")

    def _decode_view(self, ctx: Any) -> Any:
        """A decode step's view, mapped once for all the step's window layers (they share `block_map`; mapping
        per layer took ~0.28 ms of a 3.3 ms Gemma 3 270M step at 16k x 64 rows, H100) and kept on the context,
        which serves one forward (the runner builds one a step, inside its graph)."""
        kept, key = ctx.__dict__.setdefault("_window_views", {}), id(self.block_map)
        if key not in kept:
            kept[key] = replace(ctx, block_tables=self.block_map[ctx.block_tables.long()].to(torch.int32),
                                slot_mapping=self._slots(ctx.slot_mapping))
        return kept[key]

    def ring_slots(self, slots: Tensor, positions: Tensor, end: Tensor) -> Tensor:
        """Where a forward's tokens (their sequences ending at `end`) go in the rings: only the positions the next
        query can see (end - W + 1 ..), the rest to the scratch block 0, so no two tokens write one ring slot."""
        keep = positions >= end - self.window + 1
        return torch.where(keep, self._slots(slots), slots % self.block_size)


@dataclass
class TurnWindow:
    """A resumed turn's cached prefill in one window layer: its new tokens attend the kept window keys and each
    other, but writing them to the ring first would overwrite slots that the turn's own earlier queries still read
    (position p and p + R * block_size share one). So the kept keys (each sequence's last W - 1 before its start,
    whole blocks, through `block_map`) and the new tokens' k/v go into a temporary paged buffer laid out as the
    shared table (position p at index p // block_size), the context's own attention runs on it with the turn's
    temporary tables, and only then are the new tokens written to the rings (`ring_slots`). Device ops only, its
    sizes a function of the context's shapes: a CUDA graph can replay it."""

    layer: WindowLayer
    ctx: Any  # the CachedPrefillContext, or its decode rows (a DecodeContext with cu_seqlens)
    seq: Tensor  # int64 [T]: each new token's sequence
    pos: Tensor  # int64 [T]: its position
    start: Tensor  # int64 [S]: each sequence's first new position
    end: Tensor  # int64 [S]: one past its last
    tables: Tensor  # [S, width]: its shared-table blocks

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv: Tensor, kv_written: bool = False, window: int = 0,
               sinks: Tensor | None = None) -> Tensor:
        L, ctx = self.layer, self.ctx
        bs, W = L.block_size, L.window
        S, width = self.tables.shape
        T = self.pos.numel()
        first = (self.start - W + 1).clamp(min=0) // bs  # each sequence's first index a query reads
        count = ((self.end - 1).div(bs, rounding_mode="floor") - first + 1).clamp(min=0)
        base = 1 + torch.cumsum(count, 0) - count  # its temporary blocks (0: scratch)
        i = torch.arange(width, device=kv.device)[None, :]
        inside = (i >= first[:, None]) & (i < (first + count)[:, None])
        tmp_table = torch.where(inside, base[:, None] + i - first[:, None], 0)
        # at most W - 1 + n_s positions a sequence: ceil(T / bs) + S * (ceil((W - 1) / bs) + 2) blocks, scratch aside
        tmp = kv.new_zeros(2, 1 + -(-T // bs) + S * (-(-(W - 1) // bs) + 2), *kv.shape[2:])
        kept = inside & (i * bs < self.start[:, None])  # the blocks of the kept keys: read from the rings
        src = torch.where(kept, L.block_map[self.tables.long()], 0).flatten()
        tmp[:, torch.where(kept, tmp_table, 0).flatten()] = kv[:, src]  # (the non-kept to scratch)
        tmp_slots = tmp_table[self.seq, self.pos // bs] * bs + self.pos % bs
        write_kv(k, v, tmp, tmp_slots)
        write_kv(k, v, kv, L.ring_slots(ctx.slot_mapping, self.pos, self.end[self.seq]))
        if type(ctx).__name__ == "DecodeContext":
            view = replace(ctx, block_tables=tmp_table[self.seq].to(torch.int32), slot_mapping=tmp_slots)
        else:
            view = replace(ctx, block_tables=tmp_table.to(torch.int32), slot_mapping=tmp_slots,
                           key_slots=self._key_slots(tmp_table))
        return view.attend(q, k, v, tmp, True, window, sinks)

    def _key_slots(self, tmp_table: Tensor) -> Tensor:
        """The gathering backends' key slots (each sequence's positions 0.., end to end) in the temporary buffer."""
        cu_k, K = self.ctx.cu_seqlens_k.long(), self.ctx.key_slots.numel()
        S, width = tmp_table.shape
        j = torch.arange(K, device=cu_k.device)
        seq = sequence_of_rows(cu_k, j).clamp(max=S - 1)
        pos = (j - cu_k[seq]).clamp(0, width * self.layer.block_size - 1)  # rows past the last sequence: unread
        return tmp_table[seq, pos // self.layer.block_size] * self.layer.block_size + pos % self.layer.block_size
