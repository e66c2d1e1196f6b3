"""`RecurrentState`: the cache kind of linear-attention layers (Qwen3.5's Gated DeltaNet, `monorl.model.qwen3_5`).

A sequence's state is a fixed-size row, whatever its length: per layer, the conv state (the last K - 1 inputs of
the causal conv, [K - 1, conv_dim], the cache dtype) and the delta-rule state ([Hv, Dk, Dv], fp32). Nothing per
token (`bytes_per_block` 0). Row 0 is scratch (the padded rows of a CUDA-graph batch and a static pack's fillers
write there, as they write the scratch block 0).

Where a sequence's row is: in `SequenceState.kind_state["recurrent"]`, and on the device in `row_of_block`: every
block a sequence is given (`Cache.extend`) maps to its row, so a layer finds each sequence's row from the cache slot
its last token writes (`RecurrentLayer.rows`: a block a sequence writes is always its own), with no new tensor in
the attention contexts. Life of a row:

- allocated at the sequence's first `Cache.extend` / `Cache.share` (admission), freed by `Cache.free` (finish,
  preemption: a preempted sequence's whole conversation is prefilled again, from zeros, into a new row);
- a prefill writes the row from zeros; a turn's cached prefill and every decode step continue from it (a paused
  episode keeps it: its next turn prefills only the inserted tokens);
- a prompt group's prompt is prefilled once into a row of its own (`Cache.allocate_prefix`, held while the group's
  blocks are); each sample's admission copies that row into the sample's (`copy_blocks` of the prompt's last block
  to the sample's first own block);
- `covered[row]` is the number of positions the state has consumed (written by each forward). A turn whose decode
  ran past its stop (the steps between host checks, `stop_check_interval`) has a state covering tokens the request
  dropped; a state cannot be rolled back, so `Cache.trim` then frees the sequence (`keeps` is False) and its next
  turn recomputes the whole conversation, as after a preemption.

Batch-invariant mode (`batch_invariant`, set by `monorl.generate.cache.cache_kinds` for a converted generator): the
state is the one at the sequence's last chunk boundary and the row also keeps the current chunk's raw k, v, g, beta
(`kept_*`, CHUNK tokens a layer; `monorl.ops.gated_delta_invariant` says why and what it costs), counted in
`bytes_per_sequence` and so in the plan.

Rows: `monorl.generate.cache.sequence_rows(max_num_seqs)` (2 x max_num_seqs + the scratch one), whatever the
pool's blocks; the memory plan (`kv_cache_bytes_needed`) counts exactly these rows, the per-block row map and the
`covered` counts. Admission asks for a row beside its blocks (`Cache.can_extend(blocks, rows)`: a new sequence one,
its group's prompt one more), preempting paused requests when none is free, as it does for blocks.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor

from monorl.model.config import ModelConfig
from monorl.ops import gated_delta_invariant

KIND = "recurrent"  # its key in SequenceState.kind_state


class RecurrentState:
    # its prefills are never CUDA graphs: the chunked rule (fla's and the reference) reads cu_seqlens on the host
    prefill_graphs = False
    batch_invariant = False  # rows keep the current chunk's inputs (see the module docstring)
    traceable = False  # `rows` indexes with the step's slot mapping (a kernel's output in a trace pass)

    def __init__(self, cfg: ModelConfig, layer_ids: list[int]) -> None:
        self.cfg, self.layer_ids = cfg, layer_ids
        self.conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
            cfg.linear_num_value_heads * cfg.linear_value_head_dim)
        self.prefix_rows: dict[int, int] = {}  # a prompt group's first block -> its row

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 8  # its entry in `row_of_block`

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        c = self.cfg
        conv = (c.linear_conv_kernel_dim - 1) * self.conv_dim * torch.empty((), dtype=dtype).element_size()
        rule = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        kept = 0
        if self.batch_invariant:  # k, v in the cache dtype, g and beta fp32, CHUNK tokens
            c_, elt = gated_delta_invariant.CHUNK, torch.empty((), dtype=dtype).element_size()
            kept = c_ * ((self.conv_dim - c.linear_num_key_heads * c.linear_key_head_dim) * elt
                         + 2 * c.linear_num_value_heads * 4)
        return len(self.layer_ids) * (conv + rule + kept) + 8  # + its `covered` count

    def size_rows(self, rows: int | None) -> None:
        if rows is None:
            raise ValueError("a cache with linear-attention layers needs max_num_seqs (its state rows: "
                             "Cache(..., max_num_seqs=))")
        self.rows = rows

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm, self.covered, self.row_of_block,
                                                           *self.kept))

    def can_hold(self, new_rows: int) -> bool:
        return new_rows <= len(self.free_rows)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        c, L, R = self.cfg, len(self.layer_ids), self.rows
        self.block_size = block_size
        self.conv = torch.zeros(L, R, c.linear_conv_kernel_dim - 1, self.conv_dim, device=device, dtype=dtype)
        self.ssm = torch.zeros(L, R, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                               device=device, dtype=torch.float32)
        self.covered = torch.zeros(R, dtype=torch.int64, device=device)
        self.row_of_block = torch.zeros(num_blocks, dtype=torch.int64, device=device)
        self.free_rows: deque[int] = deque(range(1, R))
        self.kept: tuple[Tensor, ...] = ()
        if self.batch_invariant:
            C, hv = gated_delta_invariant.CHUNK, c.linear_num_value_heads
            self.kept = (
                torch.zeros(L, R, C, c.linear_num_key_heads, c.linear_key_head_dim, device=device, dtype=dtype),
                torch.zeros(L, R, C, hv, c.linear_value_head_dim, device=device, dtype=dtype),
                torch.zeros(L, R, C, hv, device=device, dtype=torch.float32),
                torch.zeros(L, R, C, hv, device=device, dtype=torch.float32))

    def layer_state(self, layer: int) -> RecurrentLayer:
        return RecurrentLayer(self, self.layer_ids.index(layer))

    def copy_blocks(self, src: Tensor, dst: Tensor) -> None:
        s, d = self.row_of_block[src], self.row_of_block[dst]
        self.conv[:, d] = self.conv[:, s]
        self.ssm[:, d] = self.ssm[:, s]
        self.covered[d] = self.covered[s]
        for t in self.kept:
            t[:, d] = t[:, s]

    # ---- the `Cache` operations' hooks ------------------------------------------------------------------------
    def _new_row(self) -> int:
        if not self.free_rows:
            raise RuntimeError(f"out of recurrent state rows ({self.rows - 1}): admission checks "
                               "Cache.can_extend(blocks, rows) first")
        row = self.free_rows.popleft()
        self.covered[row] = -1  # nothing computed for its new holder yet (`keeps`)
        return row

    def _map(self, blocks: list[int], row: int) -> None:
        if blocks:
            self.row_of_block[torch.tensor(blocks, device=self.row_of_block.device)] = row

    def extended(self, state: Any, blocks: list[int]) -> None:
        """A sequence was given `blocks` (or shared a prefix: none): its row (allocated now if it has none)."""
        if KIND not in state.kind_state:
            state.kind_state[KIND] = self._new_row()
        self._map(blocks, state.kind_state[KIND])

    def freed(self, state: Any) -> None:
        if (row := state.kind_state.pop(KIND, None)) is not None:
            self.free_rows.append(row)

    def keeps(self, state: Any, positions: int) -> bool:
        """Whether the sequence's state covers exactly its first `positions` positions (one host read)."""
        row = state.kind_state.get(KIND)
        return row is None or int(self.covered[row]) == positions

    def prefix_allocated(self, blocks: list[int]) -> None:
        row = self.prefix_rows[blocks[0]] = self._new_row()
        self._map(blocks, row)

    def prefix_released(self, blocks: list[int]) -> None:
        self.free_rows.append(self.prefix_rows.pop(blocks[0]))


class RecurrentLayer:
    """One linear-attention layer's view of the rows: what `monorl.model.qwen3_5.GatedDeltaNet` is handed."""

    def __init__(self, kind: RecurrentState, index: int) -> None:
        self.kind, self.index = kind, index

    def rows(self, slot_mapping: Tensor, cu_seqlens: Tensor) -> Tensor:
        """Each sequence's row: that of the block its last token is written to (empty sequences: scratch row 0)."""
        cu = cu_seqlens.long()
        last = (cu[1:] - 1).clamp(min=0)
        rows = self.kind.row_of_block[slot_mapping[last] // self.kind.block_size]
        return torch.where(cu[1:] > cu[:-1], rows, 0)

    def read(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        return self.kind.conv[self.index, rows], self.kind.ssm[self.index, rows]

    def read_kept(self, rows: Tensor) -> tuple[Tensor, ...]:
        """Batch-invariant mode: each row's kept chunk (k, v, g, beta); a one-line error for a cache not built
        for the mode."""
        if not self.kind.batch_invariant:
            raise ValueError("a batch-invariant hybrid model's generator needs its cache built for the mode (a "
                             "batch-invariant policy given to Generator, or Cache(..., batch_invariant=True))")
        return tuple(t[self.index, rows] for t in self.kind.kept)

    def write_kept(self, rows: Tensor, kept: tuple[Tensor, ...]) -> None:
        for t, x in zip(self.kind.kept, kept, strict=True):
            t[self.index, rows] = x.to(t.dtype)

    def states(self) -> tuple[Tensor, Tensor]:
        """This layer's conv [R, K - 1, conv_dim] and delta-rule [R, Hv, Dk, Dv] states: views, which a decode step
        on CUDA updates in place (`monorl.ops.gated_delta_decode`)."""
        return self.kind.conv[self.index], self.kind.ssm[self.index]

    def stepped(self, rows: Tensor, ends: Tensor) -> None:
        """`rows`' states were advanced in place to cover `ends` positions: counted once a step (by the first
        layer; every layer covers the same)."""
        if self.index == 0:
            self.kind.covered[rows] = ends

    def write(self, rows: Tensor, conv: Tensor, ssm: Tensor, ends: Tensor) -> None:
        k = self.kind
        k.conv[self.index, rows] = conv.to(k.conv.dtype)
        k.ssm[self.index, rows] = ssm.float()
        k.covered[rows] = ends
