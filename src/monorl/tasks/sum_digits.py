"""sum_digits: the reference task of TorchTitan RL (its `rl_grpo_qwen3_0_6b` experiment).

What the reference does (pytorch/torchtitan, torchtitan/experiments/rl: `sum_digits.py`,
`examples/sum_digits/{data,env,rubric}.py`, `config_registry.py`), reproduced here:

- problems: ``n = rng.randint(2, 4)`` numbers, each ``rng.randint(10, 99)``, from ``random.Random(seed)``;
  train seed 42, validation seed 99. With the default settings this class draws from the same stream in the
  same order (`train_prompts(42)` yields the reference's training problems, except that any problem that is
  also in the held-out set is skipped; see below).
- question: ``f"What is the total digit sum of {numbers}?"`` (a Python list, ``[12, 345, 67]``).
- instructions: the reference sends them as a system message (earlier versions prepended them to the
  question with a blank line). `Prompt` has one user message, so with ``instructions=True`` they are
  prepended to the question, as the earlier reference did. ``instructions=False`` gives the bare question,
  which suits a tiny char-level model.
- reward: ``correctness`` = 1.0 when the *last* ``[ANSWER] <n>`` equals the digit sum, ``format`` = 0.3 when
  any ``[ANSWER] <n>`` tag is present (regex ``\\[ANSWER\\]\\s*-?\\d+``); the reference's
  ``SumDigitsEnv.Config(correctness_reward=1.0, format_reward=0.3)``. Its later `Rubric` divides the weights by
  their sum (1.3); monorl reports the unscaled components and sums them. With std-normalised advantages the
  scale makes no difference; with mean-only advantages it scales the gradient by 1.3.

What monorl adds: configurable size (how many numbers, how many digits each) so a tiny model can learn a
small version, a held-out validation set that the training stream never repeats, a resumable stream position,
and `solution(prompt)`, a correct completion in the reference's worked-example style for a supervised warm
start.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from monorl.tasks.base import Prompt, Task
from monorl.tasks.seeded import train_stream

INSTRUCTIONS = """\
You are a helpful assistant. Solve the problem step by step.
When you have your final answer, state it as [ANSWER] <number>.

Example:
User: What is the total digit sum of [12, 345, 67]?
Assistant: Break each number into digits:
12 -> 1, 2
345 -> 3, 4, 5
67 -> 6, 7
Sum all digits: 1 + 2 + 3 + 4 + 5 + 6 + 7 = 28
[ANSWER] 28"""

_ANSWER_RE = re.compile(r"\[ANSWER\]\s*(-?\d+)")


def digit_sum(numbers: list[int]) -> int:
    return sum(int(d) for x in numbers for d in str(abs(x)))


SOLUTION_STYLES = ("steps", "short", "mixed")


class SumDigitsTask(Task):
    """Digit sums of short lists of numbers. Defaults reproduce the reference (2-4 two-digit numbers).

    Args:
        min_numbers: fewest numbers in a problem
        max_numbers: most numbers in a problem
        min_digits: fewest digits of a number
        max_digits: most digits of a number
        instructions: prepend the instructions (answer format and a worked example) to each prompt
        correctness_reward: reward of a correct answer
        format_reward: reward of an answer in the [ANSWER] <number> format, right or wrong
        val_seed: seed of the held-out problems
        val_size: held-out problems (default: 64, fewer when the problem space is small)
        solution_style: the warm start's reference solutions: steps, short or mixed
    """

    name = "sum_digits"
    reward_components = ("correctness", "format")

    def __init__(self, min_numbers: int = 2, max_numbers: int = 4, min_digits: int = 2, max_digits: int = 2,
                 instructions: bool = True, correctness_reward: float = 1.0, format_reward: float = 0.3,
                 val_seed: int = 99, val_size: int | None = None, solution_style: str = "steps") -> None:
        if not 1 <= min_numbers <= max_numbers:
            raise ValueError(f"need 1 <= min_numbers <= max_numbers, got {min_numbers}, {max_numbers}")
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if solution_style not in SOLUTION_STYLES:
            raise ValueError(f"solution_style must be one of {SOLUTION_STYLES}, got {solution_style!r}")
        self.min_numbers, self.max_numbers = min_numbers, max_numbers
        self.min_digits, self.max_digits = min_digits, max_digits
        self.instructions = instructions
        self.correctness_reward, self.format_reward = float(correctness_reward), float(format_reward)
        self.solution_style = solution_style
        self.val_seed = val_seed
        n_values = 10 ** max_digits - 10 ** (min_digits - 1)
        space = sum(n_values ** k for k in range(min_numbers, max_numbers + 1))
        # Default: 64 held-out problems, fewer when the problem space is tiny, so training keeps 3/4 of it.
        self.val_size = min(64, space // 4) if val_size is None else val_size
        if not 1 <= self.val_size <= space // 2:
            raise ValueError(f"val_size={self.val_size} must be in [1, {space // 2}]: this configuration has only "
                             f"{space} distinct problems and at least half of them must stay for training")
        self._val = self._distinct(random.Random(val_seed), self.val_size)
        self._val_keys = {tuple(x) for x in self._val}

    # -- problems -------------------------------------------------------------------------------------------
    def _draw(self, rng: random.Random) -> list[int]:
        n = rng.randint(self.min_numbers, self.max_numbers)
        out = []
        for _ in range(n):
            # Only draw a digit count when it varies, so the default stream is the reference's stream.
            d = self.min_digits if self.min_digits == self.max_digits else rng.randint(self.min_digits, self.max_digits)
            out.append(rng.randint(10 ** (d - 1), 10 ** d - 1))
        return out

    def _distinct(self, rng: random.Random, n: int) -> list[list[int]]:
        seen: set[tuple[int, ...]] = set()
        out = []
        while len(out) < n:
            x = self._draw(rng)
            if tuple(x) not in seen:
                seen.add(tuple(x))
                out.append(x)
        return out

    def _prompt(self, numbers: list[int], **meta: object) -> Prompt:
        question = f"What is the total digit sum of {numbers}?"
        text = f"{INSTRUCTIONS}\n\n{question}" if self.instructions else question
        return Prompt(text=text, answer=digit_sum(numbers), meta={"numbers": list(numbers), **meta})

    def train_prompts(self, seed: int = 42, start: int = 0) -> Iterator[Prompt]:
        # held out: never train on a validation problem; resuming replays the stream up to `start` (microseconds)
        draw = lambda rng: tuple(self._draw(rng))  # noqa: E731 -- hashable, as the held-out keys are
        for index, numbers in train_stream(draw, seed, start, self.val_seed, self._val_keys):
            yield self._prompt(list(numbers), index=index, split="train")

    def val_prompts(self, n: int) -> list[Prompt]:
        if not 0 <= n <= self.val_size:
            raise ValueError(f"asked for {n} validation prompts; the held-out set has val_size={self.val_size}")
        return [self._prompt(x, index=i, split="val") for i, x in enumerate(self._val[:n])]

    # -- reward ---------------------------------------------------------------------------------------------
    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        matches = _ANSWER_RE.findall(completion)
        correct = bool(matches) and int(matches[-1]) == int(prompt.answer)
        return {"correctness": self.correctness_reward if correct else 0.0,
                "format": self.format_reward if matches else 0.0}

    def solution(self, prompt: Prompt) -> str:
        """A correct, well-formatted completion (the reference's worked-example style), for a supervised warm
        start. ``solution_style="short"`` gives just the answer tag. ``"mixed"`` answers correctly but uses
        the tag only on even stream positions (``"The answer is n."`` otherwise): a warm-started model then
        knows the task but not reliably the rewarded format, as a base model often does, and RL has a
        signal to learn from."""
        numbers = prompt.meta["numbers"]
        total = digit_sum(numbers)
        if self.solution_style == "short":
            return f"[ANSWER] {total}"
        if self.solution_style == "mixed":
            return f"[ANSWER] {total}" if prompt.meta.get("index", 0) % 2 == 0 else f"The answer is {total}."
        lines = ["Break each number into digits:"]
        lines += [f"{x} -> {', '.join(str(abs(x)))}" for x in numbers]
        digits = [d for x in numbers for d in str(abs(x))]
        lines.append(f"Sum all digits: {' + '.join(digits)} = {total}")
        lines.append(f"[ANSWER] {total}")
        return "\n".join(lines)
