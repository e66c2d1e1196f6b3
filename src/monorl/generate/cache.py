"""The engine's cache: what a sequence keeps per layer kind between its forwards, as a small interface.

A *layer cache kind* (`LayerCache`) is one kind of per-layer state over a set of the model's layers: it says what it
holds per token and per sequence (the memory plan and the generator's default budget ask it: `kv_cache_bytes_needed`),
allocates its storage for a pool of blocks, hands each of its layers the tensor that layer's attention context reads
and writes (`layers`), and copies blocks. `Cache` puts the kinds of a model over one pool of fixed-size blocks
(`BlockPool`: a free list and refcounts) and owns every per-sequence operation the engine does: allocate / extend /
trim / free a sequence's state (`SequenceState`: its block table and how many positions hold state), share a prefix
(a group's prompt blocks, refcounted) and copy a partial block. The engine (`monorl.generate.engine`) sees only
`Cache` and `SequenceState`; a kind is chosen per layer by `cache_kinds`, so a new kind is a new class there, not a
branch in the engine.

The first kind, `PagedKV` (full attention): `kv[layer, 0 | 1, block, slot_in_block, kv_head, head_dim]` (0 = keys,
1 = values). Token p of a sequence lives at `table[p // block_size]`, slot `p % block_size`. The n samples of one
prompt share the prompt's full blocks (refcounted); the partial last block is copied per sample. Block 0 is never
handed out: padded rows of a CUDA-graph batch write their (ignored) keys there.

How the next kinds plug in (each is a class beside `PagedKV`, registered in `CACHE_KINDS` under its
`ModelConfig.layer_type`, and its layers' attention context reads its tensor; per-sequence data of its own lives in
`SequenceState.kind_state[<kind>]`, set and freed by the kind inside `Cache`'s operations, never by the engine):

- **Sliding window** (`monorl.generate.window_cache.RecycledWindowKV`, registered for "sliding_attention"): a
  layer attending its last W keys keeps them in a pool of its own, a ring of `blocks_for(W) + 1` blocks per
  sequence (`bytes_per_sequence`; `bytes_per_block` its block-map entry), reached through a map from each shared
  block to its window block; a prefill writes only the last W - 1 positions, a resumed turn attends through a
  temporary copy of the kept keys before writing its own, and a decode overrun that reached the kept keys frees
  the sequence (`keeps`).
- **Linear attention / Gated DeltaNet** (`monorl.generate.recurrent_state.RecurrentState`, registered for
  "linear_attention"): a per-sequence recurrent state and a short convolution state, no per-token keys:
  `bytes_per_block` 0, `bytes_per_sequence` the states' size; a row per sequence (its id in `kind_state`, found by
  the layers through the blocks the sequence writes), allocated at admission, kept across an episode's turns,
  freed with the request; a prompt group's prompt state has a row of its own, copied into each sample's; a
  preempted sequence (or one whose decode ran past its stop) recomputes it. Its hooks (`extended`, `freed`,
  `keeps`, `prefix_allocated`, `prefix_released`) are called by `Cache`'s operations.
- **Image embeddings** (a request's vision encoder output, computed once per request): `bytes_per_sequence` the
  embeddings of its images, held from admission to the request's end, not per layer; the prefill reads them where
  the prompt has image placeholder tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from monorl.generate.block_pool import BlockPool
from monorl.generate.recurrent_state import RecurrentState
from monorl.generate.window_cache import RecycledWindowKV
from monorl.model.config import ModelConfig


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class LayerCache(Protocol):
    """One kind of per-layer state over some of the model's layers (the module docstring)."""

    layer_ids: list[int]  # the model layers of this kind
    # whether a kernel-trace pass (`Generator.trace_kernels`: Triton launches skipped, their outputs garbage) can run
    # its layers: False where a PyTorch op indexes with a kernel's output (a slot mapped to a row or a window block)
    traceable: bool

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block of `block_size` tokens of one sequence costs over all this kind's layers."""
        ...

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        """Bytes a sequence costs whatever its length (a recurrent state; 0 for paged KV)."""
        ...

    def allocate(self, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate this kind's storage for `num_blocks` blocks."""
        ...

    def allocated_bytes(self) -> int:
        """Bytes of this kind's storage as allocated (what the memory plan must have counted)."""
        ...

    def layer_state(self, layer: int) -> Tensor:
        """What layer `layer`'s attention context is handed as `cache`."""
        ...

    def copy_blocks(self, src: Tensor, dst: Tensor) -> None:
        """Copy blocks src[i] -> dst[i] of every layer of this kind."""
        ...


class PagedKV:
    """Paged full-attention keys and values: the first `LayerCache` kind."""

    traceable = True  # its slots reach only Triton kernels (the write, the attention)

    def __init__(self, cfg: ModelConfig, layer_ids: list[int]) -> None:
        self.cfg, self.layer_ids = cfg, layer_ids
        self.kv: Tensor | None = None

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return len(self.layer_ids) * 2 * block_size * self.cfg.num_kv_heads * self.cfg.head_dim * elem

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        return 0

    def allocate(self, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        cfg = self.cfg
        self.kv = torch.zeros(len(self.layer_ids), 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                              device=device, dtype=dtype)

    def allocated_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def layer_state(self, layer: int) -> Tensor:
        # one view per layer, [2, blocks, block_size, kv_heads, head_dim]: a single tensor (not a k/v pair of views
        # into one storage), so a compiled block sees one mutated input and updates it in place
        assert self.kv is not None
        return self.kv[self.layer_ids.index(layer)]

    def copy_blocks(self, src: Tensor, dst: Tensor) -> None:
        assert self.kv is not None
        self.kv[:, :, dst] = self.kv[:, :, src]


# the cache kind of each layer kind (`ModelConfig.layer_type`): a new layer kind registers its class here
CACHE_KINDS: dict[str, type] = {"full_attention": PagedKV, "sliding_attention": RecycledWindowKV,
                               "linear_attention": RecurrentState}


def traceable(cfg: ModelConfig) -> bool:
    """Whether a kernel-trace pass can run this model's generator (every layer kind's `LayerCache.traceable`)."""
    return all(CACHE_KINDS[cfg.layer_type(i)].traceable for i in range(cfg.num_layers))


def cache_kinds(cfg: ModelConfig) -> list[LayerCache]:
    """The cache kinds of a model's layers: one instance per layer kind present, over that kind's layers."""
    by_type: dict[str, list[int]] = {}
    for i in range(cfg.num_layers):
        by_type.setdefault(cfg.layer_type(i), []).append(i)
    return [CACHE_KINDS[t](cfg, ids) for t, ids in by_type.items()]


def _kinds(cfg: ModelConfig, batch_invariant: bool, block_size: int = 0) -> list[LayerCache]:
    """`cache_kinds`, for a batch-invariant generator telling a kind whose rows differ in that mode (its
    `batch_invariant` attribute: the recurrent state's kept chunk) so before it is sized, and a kind whose rows
    hold blocks (a recycled window's ring: its `block_size` attribute) the block size."""
    kinds = cache_kinds(cfg)
    for k in kinds:
        if batch_invariant and hasattr(k, "batch_invariant"):
            k.batch_invariant = True
        if hasattr(k, "block_size"):
            k.block_size = block_size
    return kinds


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """What one block of one sequence costs over every layer kind of `cfg`."""
    return sum(k.bytes_per_block(block_size, dtype) for k in cache_kinds(cfg))


def sequence_rows(max_num_seqs: int) -> int:
    """The per-sequence rows a cache holds (a recurrent kind's states), scratch row included: the decode slots'
    sequences, and as many again for paused episodes and prompt groups' prompt rows (a round's groups hold one
    each while their samples take slots). A turn that finds none free preempts paused requests, as for blocks
    (`Cache.can_extend`)."""
    return 2 * max_num_seqs + 1


def bytes_per_sequence(cfg: ModelConfig, dtype: torch.dtype, batch_invariant: bool = False,
                       block_size: int = 0) -> int:
    """What one sequence row costs over every layer kind of `cfg` (0 without per-sequence state)."""
    return sum(k.bytes_per_sequence(dtype) for k in _kinds(cfg, batch_invariant, block_size))


def blocks_in_budget(cfg: ModelConfig, budget: int, max_num_seqs: int, block_size: int, dtype: torch.dtype,
                     batch_invariant: bool = False) -> int:
    """The blocks `budget` bytes hold once the cache's `sequence_rows(max_num_seqs)` rows are set aside."""
    rows = sequence_rows(max_num_seqs) * bytes_per_sequence(cfg, dtype, batch_invariant, block_size)
    return max(0, budget - rows) // bytes_per_block(cfg, block_size, dtype)


def kv_cache_bytes_needed(cfg: ModelConfig, max_num_seqs: int, max_model_len: int, block_size: int,
                          dtype: torch.dtype, rows_for: int | None = None, batch_invariant: bool = False) -> int:
    """What `max_num_seqs` sequences of `max_model_len` tokens need, plus the scratch block (the generator's
    default budget, and the memory plan's KV row): each kind's per-block bytes, and its per-sequence bytes times
    `sequence_rows(rows_for)` (the generator's `max_num_seqs`, default this one's): what `Cache` allocates."""
    blocks = max_num_seqs * blocks_for(max_model_len, block_size) + 1
    rows = sequence_rows(max_num_seqs if rows_for is None else rows_for)
    return sum(blocks * k.bytes_per_block(block_size, dtype) + rows * k.bytes_per_sequence(dtype)
               for k in _kinds(cfg, batch_invariant, block_size))


@dataclass
class SequenceState:
    """A sequence's cache state: its blocks (positions p at `table[p // block_size]`) and how many of its positions
    hold state computed for it (`cached`)."""

    table: list[int] = field(default_factory=list)
    cached: int = 0
    # per-sequence state a kind owns beyond the shared block table, keyed by the kind (a recurrent kind's state
    # row, a window kind's own table): the kind sets and frees it in the `Cache` operations
    kind_state: dict[str, Any] = field(default_factory=dict)


class Cache:
    """A model's cache kinds over one pool of `num_blocks` blocks of `block_size` tokens: every per-sequence
    operation of the engine."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, max_num_seqs: int | None = None, batch_invariant: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"KV cache budget too small: {num_blocks} blocks (need >= 2)")
        self.block_size, self.num_blocks, self.device, self.dtype = block_size, num_blocks, device, dtype
        self.kinds = _kinds(cfg, batch_invariant, block_size)
        # a kind with per-sequence rows sizes them by the decode slots (`sequence_rows`), not by the blocks
        self._hook("size_rows", None if max_num_seqs is None else sequence_rows(max_num_seqs))
        for kind in self.kinds:
            kind.allocate(num_blocks, block_size, device, dtype)
        # whether a prefill may be a CUDA graph (a kind whose prefill reads its sequences' bounds on the host: no)
        self.prefill_graphs = all(getattr(k, "prefill_graphs", True) for k in self.kinds)
        by_layer = {i: kind for kind in self.kinds for i in kind.layer_ids}
        self.layers = [by_layer[i].layer_state(i) for i in range(cfg.num_layers)]  # what the model is handed
        self.blocks = BlockPool(num_blocks)

    @property
    def kv(self) -> Tensor:
        """The paged full-attention kind's tensor (tests and the memory plan read it)."""
        paged = next(k for k in self.kinds if type(k) is PagedKV)
        assert paged.kv is not None
        return paged.kv

    def allocated_bytes(self) -> int:
        """Bytes of every kind's storage (the memory plan's KV row is this)."""
        return sum(k.allocated_bytes() for k in self.kinds)

    def blocks_needed(self, positions: int) -> int:
        """Blocks a sequence whose state covers `positions` positions holds."""
        return blocks_for(positions, self.block_size)

    def can_extend(self, n_blocks: int, new_rows: int = 0) -> bool:
        """Whether `n_blocks` blocks and `new_rows` sequence rows (a new sequence's, a group's prompt's) are free."""
        return self.blocks.can_allocate(n_blocks) and all(self._hook("can_hold", new_rows))

    def _hook(self, name: str, *args: Any) -> list[Any]:
        """Call the kinds' optional hook `name` (a kind with per-sequence state of its own: `RecurrentState`)."""
        return [hook(*args) for k in self.kinds if (hook := getattr(k, name, None)) is not None]

    @property
    def copies_prompt_state(self) -> bool:
        """A kind keeps per-sequence state past the blocks (a recurrent row): a group's samples copy it even when
        the prompt ends on a block boundary (`copy_blocks` of its last block)."""
        return any(isinstance(k, RecurrentState) for k in self.kinds)

    def extend(self, state: SequenceState, n_blocks: int) -> list[int]:
        """Give a sequence `n_blocks` more blocks (at the end of its table); returns them."""
        new = self.blocks.allocate(n_blocks)
        state.table += new
        self._hook("extended", state, new)
        return new

    def share(self, state: SequenceState, blocks: list[int]) -> None:
        """Start a sequence's table with a prefix others hold (a group's prompt blocks: refcounted)."""
        assert not state.table
        self.blocks.incref(blocks)
        state.table = list(blocks)
        self._hook("shared", state, blocks)  # (a recycled window's ring: the group's it reads)
        self._hook("extended", state, [])

    def allocate_prefix(self, n_blocks: int) -> list[int]:
        """Blocks for a prompt group's prompt, prefilled once (and a recurrent kind's row for its final state)."""
        blocks = self.blocks.allocate(n_blocks)
        self._hook("prefix_allocated", blocks)
        return blocks

    def release_prefix(self, blocks: list[int]) -> None:
        self.blocks.release(blocks)
        self._hook("prefix_released", blocks)

    def trim(self, state: SequenceState, positions: int) -> None:
        """Hand back the blocks past those `positions` positions use; a sequence whose recurrent state covers other
        positions (its decode ran past its stop) is freed instead, to be recomputed."""
        if not all(self._hook("keeps", state, positions)):
            self.free(state)
            return
        keep = self.blocks_needed(positions)
        self.blocks.release(state.table[keep:])
        del state.table[keep:]

    def free(self, state: SequenceState) -> None:
        if state.table:
            self.blocks.release(state.table)
        state.table, state.cached = [], 0
        self._hook("freed", state)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy partial blocks (src, dst) in every kind: a sample's own copy of its group's last prompt block."""
        if pairs:
            src = torch.tensor([p[0] for p in pairs], device=self.device)
            dst = torch.tensor([p[1] for p in pairs], device=self.device)
            for kind in self.kinds:
                kind.copy_blocks(src, dst)


def slot_mapping(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots (block * block_size + offset) of positions start..end-1."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def table_tensor(tables: list[list[int]], width: int, device: torch.device) -> Tensor:
    out = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out.to(device)
