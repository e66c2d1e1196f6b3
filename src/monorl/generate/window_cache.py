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

Not yet: a resumed turn's cached prefill (`CachedPrefillContext`): its new tokens would alias ring slots that its
earlier queries still read; `window_context` refuses it with a one-line error. Until then `SlidingWindowKV`
(no recycling) stays the registered kind; this one is chosen with `CACHE_KINDS["sliding_attention"]`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from monorl.model.config import ModelConfig

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
        from monorl.generate.cache import BlockPool

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
        return True

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
        """`ctx` with this layer's blocks: tables and slots mapped through `block_map`."""
        name = type(ctx).__name__
        if name == "DecodeContext":
            if ctx.cu_seqlens is not None:
                raise NotImplementedError("recycled window layers: a resumed turn's cached prefill is not "
                                          "supported yet (use SlidingWindowKV)")
            return replace(ctx, block_tables=self.block_map[ctx.block_tables.long()].to(torch.int32),
                           slot_mapping=self._slots(ctx.slot_mapping))
        if name == "PrefillContext":
            v = ctx.varlen
            cu = v.cu_seqlens.long()
            T = ctx.slot_mapping.numel()
            seq = torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True).clamp(max=cu.numel() - 2)
            end = (cu[1:] - cu[:-1])[seq]
            keep = v.positions[:T] >= end - self.window + 1  # what the next query sees; the rest to scratch
            slots = torch.where(keep, self._slots(ctx.slot_mapping), ctx.slot_mapping % self.block_size)
            return replace(ctx, slot_mapping=slots)
        raise NotImplementedError("recycled window layers: a resumed turn's cached prefill is not supported yet "
                                  "(use SlidingWindowKV)")
