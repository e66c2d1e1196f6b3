"""arith: small integer arithmetic as chat prompts (issue #43: a task a 135M instruct model learns in minutes).

A problem is ``a + b`` or ``a * b`` with operands of fixed digit counts (default: 2-digit + 2-digit, 2-digit x
1-digit), asked as ``What is 37 + 58?`` in a user turn. The answer format is ``Answer: <number>``. A small
instruct model (SmolLM2-135M-Instruct, greedy, measured on CPU) ignores a format request written as text ("Give
only the final answer as: Answer: <number>": 0/48 followed it) but follows one worked exchange in the
conversation (64/64; 8/64 correct), and the text request added to that exchange made it worse (47/64 followed,
3/64 correct). So by default the prompt is a one-shot chat, ``user: What is 12 + 34?`` / ``assistant: Answer: 46``
/ ``user: What is 37 + 58?``, and the format is stated as text only without shots. The example problems never
appear as training or held-out problems.

Rewards: ``correctness`` when the first ``Answer: <n>`` in the completion is the exact result (the first, so listing
several answers does not pay), ``format`` when the completion is that answer line and nothing else.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence

from monorl.tasks.base import Prompt, Task
from monorl.tasks.seeded import train_stream

OPS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}
INSTRUCTION = "Give only the final answer as: Answer: <number>"
# the worked exchanges a few-shot prompt starts with, one per shot (excluded from both splits)
EXAMPLES = (("+", 12, 34), ("*", 23, 4))
_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)")
_ONLY_ANSWER_RE = re.compile(r"\s*Answer:\s*-?\d+\.?\s*")
SOLUTION_STYLES = ("answer", "mixed")

Problem = tuple[str, int, int]


def _parse_ops(ops: str | Sequence[str]) -> tuple[str, ...]:
    names = [o.strip() for o in (ops.split(",") if isinstance(ops, str) else ops) if o.strip()]
    if not names or any(o not in OPS for o in names) or len(set(names)) != len(names):
        raise ValueError(f"ops must be distinct operators among {', '.join(OPS)} (e.g. '+,*'), got {ops!r}")
    return tuple(names)


def _operand_range(digits: int, what: str) -> tuple[int, int]:
    if not 1 <= digits <= 9:
        raise ValueError(f"{what} must be in [1, 9], got {digits}")
    return 10 ** (digits - 1), 10 ** digits - 1


class ArithTask(Task):
    """Integer addition and multiplication as chat prompts; answer as ``Answer: <number>``.

    Args:
        ops: operators to draw from, comma-separated: "+", "*" or "+,*" (one chosen uniformly per problem)
        add_digits: digits of each addend
        mul_digits: digits of the first factor
        mul_by_digits: digits of the second factor
        shots: worked example exchanges before the question (0, 1 or 2); 0 states the format as text only
        instruction: the format request appended to the first user turn ("" for none; default: the request
            "Give only the final answer as: Answer: <number>" without shots, none with them)
        correctness_reward: reward of a correct first "Answer: <n>"
        format_reward: reward of a completion that is only the answer line, right or wrong
        val_seed: seed of the held-out problems
        val_size: held-out problems (default: 200, fewer when the problem space is small)
        solution_style: the warm start's reference solutions: answer ("Answer: n") or mixed (the bare number on
            odd stream positions, so a warm-started model does not reliably know the rewarded format)
        reply_space: whether a prompt without a chat template ends ``Assistant: `` (the char models' format) or
            ``Assistant:`` (false: for a subword tokenizer, which spells a word with the space before it, so a
            prompt ending in a space leaves the model to start mid-word; Gemma-3-270M's base model then answers
            a bare number instead of the ``Answer: n`` its examples show)
    """

    name = "arith"
    reward_components = ("correctness", "format")

    def __init__(self, ops: str | Sequence[str] = "+,*", add_digits: int = 2, mul_digits: int = 2,
                 mul_by_digits: int = 1, shots: int = 1, instruction: str | None = None,
                 correctness_reward: float = 1.0, format_reward: float = 0.2, val_seed: int = 99,
                 val_size: int | None = None, solution_style: str = "answer", reply_space: bool = True) -> None:
        self.ops = _parse_ops(ops)
        self.ranges = {"+": (_operand_range(add_digits, "add_digits"), _operand_range(add_digits, "add_digits")),
                       "*": (_operand_range(mul_digits, "mul_digits"), _operand_range(mul_by_digits, "mul_by_digits"))}
        if not 0 <= shots <= len(EXAMPLES):
            raise ValueError(f"shots must be in [0, {len(EXAMPLES)}], got {shots}")
        if solution_style not in SOLUTION_STYLES:
            raise ValueError(f"solution_style must be one of {SOLUTION_STYLES}, got {solution_style!r}")
        if instruction is None:  # the worked exchange states the format better than text does (module docstring)
            instruction = "" if shots else INSTRUCTION
        self.shots, self.instruction, self.solution_style = shots, instruction.strip(), solution_style
        self.reply_space = reply_space
        self.correctness_reward, self.format_reward = float(correctness_reward), float(format_reward)
        self.val_seed = val_seed
        self._examples = set(EXAMPLES[:shots])
        space = sum((hi_a - lo_a + 1) * (hi_b - lo_b + 1)
                    for (lo_a, hi_a), (lo_b, hi_b) in (self.ranges[o] for o in self.ops)) - len(self._examples)
        # default: 200 held-out problems (issue #43: pass@1 on >= 200), fewer when the space is small, so training
        # keeps 3/4 of it
        self.val_size = min(200, space // 4) if val_size is None else val_size
        if not 1 <= self.val_size <= space // 2:
            raise ValueError(f"val_size={self.val_size} must be in [1, {space // 2}]: this configuration has only "
                             f"{space} distinct problems and at least half of them must stay for training")
        self._val = self._distinct(random.Random(val_seed), self.val_size)
        self._held_out = set(self._val) | self._examples

    # -- problems -------------------------------------------------------------------------------------------
    def _draw(self, rng: random.Random) -> Problem:
        op = self.ops[0] if len(self.ops) == 1 else rng.choice(self.ops)
        (lo_a, hi_a), (lo_b, hi_b) = self.ranges[op]
        return op, rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)

    def _distinct(self, rng: random.Random, n: int) -> list[Problem]:
        seen, out = set(self._examples), []
        while len(out) < n:
            x = self._draw(rng)
            if x not in seen:
                seen.add(x)
                out.append(x)
        return out

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """The conversation of a problem: `shots` worked exchanges, then the question; the instruction is on the
        first user turn (the model then sees the format asked for once and answered in)."""
        turns: list[dict[str, str]] = []
        for op, a, b in EXAMPLES[:self.shots]:
            turns += [{"role": "user", "content": f"What is {a} {op} {b}?"},
                      {"role": "assistant", "content": f"Answer: {OPS[op](a, b)}"}]
        op, a, b = problem
        turns.append({"role": "user", "content": f"What is {a} {op} {b}?"})
        if self.instruction:
            turns[0] = {"role": "user", "content": f"{turns[0]['content']} {self.instruction}"}
        return turns

    def plain_prompt(self, prompt: Prompt) -> str:
        text = super().plain_prompt(prompt)
        return text if self.reply_space else text.rstrip(" ")

    def _prompt(self, problem: Problem, **meta: object) -> Prompt:
        op, a, b = problem
        turns = self.messages(problem)
        return Prompt(text=turns[-1]["content"], answer=OPS[op](a, b),
                      meta={"op": op, "a": a, "b": b, "messages": turns, **meta})

    def train_prompts(self, seed: int = 42, start: int = 0) -> Iterator[Prompt]:
        # never a validation problem (or a worked example); resuming replays the stream up to `start`
        for index, problem in train_stream(self._draw, seed, start, self.val_seed, self._held_out):
            yield self._prompt(problem, index=index, split="train")

    def val_prompts(self, n: int) -> list[Prompt]:
        if not 0 <= n <= self.val_size:
            raise ValueError(f"asked for {n} validation prompts; the held-out set has val_size={self.val_size}")
        return [self._prompt(x, index=i, split="val") for i, x in enumerate(self._val[:n])]

    # -- reward ---------------------------------------------------------------------------------------------
    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        match = _ANSWER_RE.search(completion)
        correct = match is not None and int(match.group(1)) == int(prompt.answer)
        return {"correctness": self.correctness_reward if correct else 0.0,
                "format": self.format_reward if _ONLY_ANSWER_RE.fullmatch(completion) else 0.0}

    def solution(self, prompt: Prompt) -> str:
        """A correct, well-formatted completion, for a supervised warm start (``mixed``: the bare number on odd
        stream positions, which scores correctness 0 and format 0)."""
        if self.solution_style == "mixed" and prompt.meta.get("index", 0) % 2 == 1:
            return str(prompt.answer)
        return f"Answer: {prompt.answer}"
