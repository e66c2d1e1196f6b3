"""count_squares: a visual task made at run time (#59; no files, no downloads): a small dark canvas with 1-4
coloured squares on a grid of cells (2 x 2 by default), and the question "How many squares?". The answer is a
digit, rewarded in the ``[ANSWER] n`` format (sum_digits' tag). For the tiny_vision preset: a random-init tiny
Qwen3-VL (`tiny-vl`) can only answer by looking, since the text is the same for every prompt.

The images: `grid` x `grid` cells of `cell` pixels (cell 8 = one image token of the tiny-vl tower), each square
one cell less a 1-pixel border, in a bright colour drawn per square. Problems are the (cells, colours) drawn from
``random.Random(seed)``; the held-out set (`val_seed`) never appears in the training stream.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator
from typing import Any

from monorl.tasks.base import Prompt, Task
from monorl.tasks.images import with_placeholders
from monorl.tasks.seeded import held_out, train_stream
from monorl.tasks.sum_digits import SOLUTION_STYLES

QUESTION = "How many squares?"
_ANSWER_RE = re.compile(r"\[ANSWER\]\s*(-?\d+)")
_COLOURS = ((230, 60, 60), (60, 200, 80), (70, 110, 240), (240, 210, 50), (220, 80, 220), (60, 220, 220))


def draw_squares(cells: tuple[int, ...], colours: tuple[int, ...], grid: int, cell: int) -> Any:
    """The canvas (a PIL RGB image, grid * cell pixels square) with a square in each of `cells` (row-major
    indices), in `_COLOURS[colours[i]]`."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (grid * cell, grid * cell), (20, 20, 20))
    draw = ImageDraw.Draw(image)
    for at, colour in zip(cells, colours, strict=True):
        r, c = divmod(at, grid)
        draw.rectangle((c * cell + 1, r * cell + 1, (c + 1) * cell - 2, (r + 1) * cell - 2), fill=_COLOURS[colour])
    return image


class CountSquaresTask(Task):
    """Count the coloured squares in a picture (1 to `max_count`).

    Args:
        grid: cells per side of the canvas
        cell: pixels per cell side (8: one token of the tiny-vl tower per cell)
        max_count: most squares in a picture (at least 1)
        correctness_reward: reward of ``[ANSWER] n`` with the right count
        val_seed: seed of the held-out problems
        val_size: held-out problems
        solution_style: the warm start's answers: short (``[ANSWER] n``) or mixed (that on even stream positions,
            ``There are n.`` otherwise: the warm start teaches counting but not reliably the rewarded format)
    """

    name = "count_squares"
    reward_components = ("correctness",)

    def __init__(self, grid: int = 2, cell: int = 8, max_count: int = 4, correctness_reward: float = 1.0,
                 val_seed: int = 99, val_size: int = 64, solution_style: str = "short") -> None:
        if not 1 <= max_count <= min(9, grid * grid):
            raise ValueError(f"max_count={max_count} must be in [1, min(9, grid * grid = {grid * grid})]: the "
                             "answer is one digit and each square takes a cell")
        if cell < 3:
            raise ValueError(f"cell={cell} pixels leaves no square inside its 1-pixel border; use cell >= 3")
        if solution_style not in ("short", "mixed"):
            raise ValueError(f"solution_style must be 'short' or 'mixed' (of {SOLUTION_STYLES}), got "
                             f"{solution_style!r}")
        self.grid, self.cell, self.max_count = grid, cell, max_count
        self.correctness_reward, self.solution_style = float(correctness_reward), solution_style
        self.val_seed, self.val_size = val_seed, val_size
        space = sum(math.comb(grid * grid, k) * len(_COLOURS) ** k for k in range(1, max_count + 1))
        self._val = held_out(self._draw, val_seed, val_size, space)
        self._val_keys = set(self._val)

    def _draw(self, rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
        n = rng.randint(1, self.max_count)
        cells = tuple(sorted(rng.sample(range(self.grid * self.grid), n)))
        return cells, tuple(rng.randrange(len(_COLOURS)) for _ in cells)

    def _prompt(self, problem: tuple[tuple[int, ...], tuple[int, ...]], **meta: object) -> Prompt:
        cells, colours = problem
        image = draw_squares(cells, colours, self.grid, self.cell)
        messages = with_placeholders([{"role": "user", "content": QUESTION}], 1)
        return Prompt(text=QUESTION, answer=len(cells),
                      meta={"messages": messages, "images": [image], "cells": list(cells), **meta})

    def train_prompts(self, seed: int = 42, start: int = 0) -> Iterator[Prompt]:
        for index, problem in train_stream(self._draw, seed, start, self.val_seed, self._val_keys):
            yield self._prompt(problem, index=index, split="train")

    def val_prompts(self, n: int) -> list[Prompt]:
        if not 0 <= n <= self.val_size:
            raise ValueError(f"asked for {n} validation prompts; the held-out set has val_size={self.val_size}")
        return [self._prompt(p, index=i, split="val") for i, p in enumerate(self._val[:n])]

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        matches = _ANSWER_RE.findall(completion)
        correct = bool(matches) and int(matches[-1]) == int(prompt.answer)
        return {"correctness": self.correctness_reward if correct else 0.0}

    def solution(self, prompt: Prompt) -> str:
        """The right count: ``[ANSWER] n`` (``"mixed"``: on even stream positions; ``There are n.`` otherwise)."""
        if self.solution_style == "mixed" and prompt.meta.get("index", 0) % 2:
            return f"There are {prompt.answer}."
        return f"[ANSWER] {prompt.answer}"
