"""Paged KV cache: one pool of fixed-size blocks for all layers, and the block manager.

Layout: `kv[layer, 0 | 1, block, slot_in_block, kv_head, head_dim]` (0 = keys, 1 = values). A sequence
owns a block table (list of block ids); token at position p lives at `table[p // block_size]`, slot
`p % block_size`. The n samples of one prompt share the prompt's full blocks (refcounted); the partial
last block is copied per sample. Block 0 is never handed out: padded rows of a CUDA-graph batch write
their (ignored) keys there.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from monorl.model.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        if num_blocks < 2:
            raise ValueError(f"KV cache budget too small: {num_blocks} blocks (need >= 2)")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                              device=device, dtype=dtype)
        # One view per layer, [2, blocks, block_size, kv_heads, head_dim]: what the model hands to the
        # attention context as `cache`. A single tensor (not a k/v pair of views into one storage), so a
        # compiled block sees one mutated input and updates it in place.
        self.layers = [self.kv[i] for i in range(cfg.num_layers)]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if src:
            device = self.kv.device
            s = torch.tensor(src, device=device)
            d = torch.tensor(dst, device=device)
            self.kv[:, :, d] = self.kv[:, :, s]


class BlockManager:
    """Free list + refcounts. Allocation is all-or-nothing so callers can check `can_allocate` first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))  # block 0 is the scratch block
        self.refs = [0] * num_blocks

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def num_free(self) -> int:
        return len(self.free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {n}, have {len(self.free)}")
        out = [self.free.popleft() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than referenced")


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def kv_cache_bytes_needed(cfg: ModelConfig, max_num_seqs: int, max_model_len: int, block_size: int,
                          dtype: torch.dtype) -> int:
    """What `max_num_seqs` sequences of `max_model_len` tokens need, plus the scratch block (the generator's
    default budget, and the memory plan's KV row)."""
    return (max_num_seqs * blocks_for(max_model_len, block_size) + 1) * bytes_per_block(cfg, block_size, dtype)


def slot_mapping(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots (block * block_size + offset) of positions start..end-1."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def table_tensor(tables: list[list[int]], width: int, device: torch.device) -> Tensor:
    out = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out.to(device)
