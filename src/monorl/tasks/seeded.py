"""Seeded problem streams for generated tasks (sum_digits, arith, the agent tasks): a fixed held-out set and a
training stream that never repeats it, so a resumed run draws the same problems from its position."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

P = TypeVar("P", bound=Hashable)


def held_out(draw: Callable[[random.Random], P], seed: int, n: int, space: int) -> list[P]:
    """`n` distinct problems from `random.Random(seed)` (at most half of the `space` distinct ones)."""
    if not 1 <= n <= space // 2:
        raise ValueError(f"val_size={n} must be in [1, {space // 2}]: the task has {space} distinct problems and at "
                         "least half of them must stay for training")
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        p = draw(rng)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def train_stream(draw: Callable[[random.Random], P], seed: int, start: int, val_seed: int,
                 held: set[P]) -> Iterator[tuple[int, P]]:
    """(index, problem) from `random.Random(seed)`, skipping held-out problems, from position `start` on."""
    if seed == val_seed:
        raise ValueError(f"train seed {seed} equals the validation seed; pick another")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    rng, index = random.Random(seed), 0
    while True:
        p = draw(rng)
        if p in held:
            continue
        if index >= start:
            yield index, p
        index += 1
