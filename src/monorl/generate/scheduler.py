"""Scheduler: which samples wait, which run in which slot, and when they finish.

Requests are prompt groups of n samples. A group is prefilled when its first sample is admitted; its
prompt blocks are shared by all its samples (the partial last block is copied per sample) and are
released once every sample is admitted. A sample reserves the blocks for prompt + max_new_tokens at
admission, so a running sequence never runs out of KV memory (no preemption needed) and its block
table never changes while it decodes -- which is what lets a CUDA graph run many steps unattended.
Finished sequences free their slot and blocks at the next host check; the last live slots move into
the holes so live sequences always occupy slots 0..live-1.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from torch import Tensor

from monorl.generate.kv_cache import BlockManager, blocks_for
from monorl.generate.sampling import SamplingParams


@dataclass
class Group:
    prompt: list[int]
    sampling: SamplingParams
    pending: int  # samples not admitted yet
    stop_ids: frozenset[int] = frozenset()
    blocks: list[int] | None = None  # prompt blocks, allocated at prefill
    last_logits: Tensor | None = None  # [V], the first token's distribution, kept until all samples start
    logits_version: int = 0  # the policy version of the weights that computed last_logits


@dataclass
class Sequence:
    group: Group
    sample_index: int
    key: int
    table: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token: the generator's policy_version that sampled it
    finish_reason: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.group.prompt)


class Scheduler:
    def __init__(self, blocks: BlockManager, block_size: int, max_num_seqs: int, max_prefill_tokens: int) -> None:
        self.blocks, self.block_size = blocks, block_size
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] lives in slot i

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def own_blocks(self, prompt_len: int, max_new: int) -> int:
        # KV is written for positions 0 .. prompt_len + max_new - 2 (the last sampled token is never fed).
        total = blocks_for(prompt_len + max_new - 1, self.block_size)
        return total - prompt_len // self.block_size

    def blocks_needed(self, prompt_len: int, max_new: int) -> int:
        """Worst case for one prompt with one sample (the feasibility check)."""
        return blocks_for(prompt_len, self.block_size) + self.own_blocks(prompt_len, max_new)

    def admit(self) -> tuple[list[Group], list[Sequence], list[tuple[int, int]]]:
        """Admit waiting samples while slots and blocks last. Returns (groups to prefill, admitted
        sequences, (src, dst) partial-block copies to do after the prefill)."""
        groups: list[Group] = []
        seqs: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        prefill_tokens = 0
        bs = self.block_size
        while self.waiting and len(self.running) + len(seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            g, L = seq.group, seq.prompt_len
            n_own = self.own_blocks(L, g.sampling.max_new_tokens)
            need = n_own
            if g.blocks is None:
                if groups and prefill_tokens + L > self.max_prefill_tokens:
                    break
                need += blocks_for(L, bs)
            if not self.blocks.can_allocate(need):
                break
            if g.blocks is None:
                g.blocks = self.blocks.allocate(blocks_for(L, bs))
                groups.append(g)
                prefill_tokens += L
            full = L // bs
            own = self.blocks.allocate(n_own)
            self.blocks.incref(g.blocks[:full])
            seq.table = g.blocks[:full] + own
            if L % bs and own:
                copies.append((g.blocks[full], own[0]))
            g.pending -= 1
            self.waiting.popleft()
            seqs.append(seq)
        return groups, seqs, copies

    def release_group_if_done(self, g: Group) -> None:
        if g.pending == 0 and g.blocks is not None:
            self.blocks.release(g.blocks)
            g.blocks = []
            g.last_logits = None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.blocks.release(seq.table)
        seq.table = []

    def compact(self) -> tuple[list[int], list[int]]:
        """Drop finished sequences from `running`; returns the (src, dst) slot moves that keep the
        live ones in slots 0..live-1."""
        self.running, moves = compact_slots(self.running, [s.finish_reason is None for s in self.running])
        return moves


def compact_slots(items: list, live: list[bool]) -> tuple[list, tuple[list[int], list[int]]]:
    """Slot compaction: items[i] lives in slot i. Returns (the live items, each now at its new slot index, and the
    (src, dst) slot moves that put them there): the last live items move into the holes, so live slots are 0..n-1."""
    n = sum(live)
    holes = [i for i in range(n) if not live[i]]
    movers = [i for i in range(n, len(items)) if live[i]]
    new = list(items)
    for h, m in zip(holes, movers, strict=True):
        new[h] = items[m]
    return new[:n], (movers, holes)
