"""The training prompt stream of a run: `task.train_prompts(seed, start)` that knows its position."""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Iterator

from monorl.tasks.base import Prompt, Task


class PromptStream:
    """`task.train_prompts(seed, start)` that knows its position (the index of the next prompt it yields),
    which is what a checkpoint stores so that a resumed run draws the same prompts."""

    def __init__(self, task: Task, seed: int, start: int = 0) -> None:
        self.task_name = task.name
        self.position = start
        self._it = task.train_prompts(seed=seed, start=start)
        self._ahead: deque[Prompt] = deque()  # drawn from the task by `peek`, not yet yielded

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def peek(self, n: int) -> list[Prompt]:
        """The next n prompts (fewer where a finite stream ends) without taking them: `next` yields these same
        objects, and `position` moves only then (a checkpoint in between stores the position before them)."""
        while len(self._ahead) < n:
            p = next(self._it, None)
            if p is None:
                break
            self._ahead.append(p)
        return list(itertools.islice(self._ahead, n))

    def __next__(self) -> Prompt:
        p = self._ahead.popleft() if self._ahead else next(self._it)
        index = p.meta.get("index")
        if index is None:  # a task without stream indices: count what was drawn
            self.position += 1
        else:
            if index < self.position:  # the task replayed from 0: a resume would silently repeat data
                raise ValueError(f"task {self.task_name!r}: train_prompts yielded index {index} after position "
                                 f"{self.position}; it must honour `start` (see monorl.tasks.base.Task)")
            self.position = int(index) + 1
        return p


def shuffled_rows(n: int, seed: int, start: int = 0) -> Iterator[tuple[int, int, int]]:
    """An endless stream over `n` rows, reshuffled every epoch: (stream index, epoch, row) from position `start`
    on. A permutation per (seed, epoch) makes any position reachable without replaying the stream, which is
    what `Task.train_prompts(seed, start)` needs to resume."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    index = start
    while True:
        epoch = index // n
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for pos in range(index % n, n):
            yield index, epoch, order[pos]
            index += 1
