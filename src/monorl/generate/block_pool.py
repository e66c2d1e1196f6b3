"""A pool of fixed-size cache blocks: a free list and refcounts (the engine's `Cache` holds one; a kind with a pool
of its own, the recycled sliding window's, another)."""

from __future__ import annotations

from collections import deque


class BlockPool:
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
