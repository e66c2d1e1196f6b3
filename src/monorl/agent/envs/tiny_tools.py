"""tiny_tools: a task a tiny char-level model (the ``tiny`` preset: no files, no downloads) can only solve with a
tool. Each problem has its own secret function ``f(x) = a*x + b`` (a in 2..9, b in 0..9); the question is
``f(3)=?`` and ``f`` is reachable only as the tool ``f(x: int) -> int``. The right episode is two turns:

    User: f(3)=?
    Assistant: <tool_call>{"name":"f","arguments":{"x":3}}</tool_call><eos>
    Tool: 23
    Assistant: 23<eos>

``correctness`` (1.0) needs both: the final answer (the last integer of the last assistant turn, a turn without a
call) equals f(x), and the episode called ``f`` with that x successfully, so guessing (1 in ~80) scores nothing.
The tool schemas are not rendered (`render_tools = False`): the whole episode (plain rendering, one token a
character) is about 100 tokens, inside the ``tiny`` preset's 128. `solution_messages(prompt)` is the
right episode for a supervised warm start (assistant turns to train on, the tool turn masked).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from typing import Any

from monorl.agent.calls import format_tool_call, parse_tool_calls
from monorl.agent.env import EpisodeEnv, ToolEnv
from monorl.agent.task import AgentTask
from monorl.agent.tools import ToolSet
from monorl.tasks.base import Prompt
from monorl.tasks.seeded import held_out, train_stream

_INT = re.compile(r"-?\d+")
Problem = tuple[int, int, int]  # (a, b, x)


def secret_function(a: int, b: int) -> Callable[[int], int]:
    """The tool ``f`` of one problem."""

    def f(x: int) -> int:
        """The secret function.

        Args:
            x: The input.
        """
        return a * x + b

    return f


def _draw(rng: random.Random) -> Problem:
    return rng.randint(2, 9), rng.randint(0, 9), rng.randint(0, 9)


class TinyToolsTask(AgentTask):
    """f(x) of a per-problem secret linear function, reachable only through the tool ``f``."""

    name = "tiny_tools"
    reward_components = ("correctness", "tool")
    render_tools = False

    def __init__(self, max_turns: int = 3, val_seed: int = 99, val_size: int = 64,
                 solution_style: str = "tool", tool_reward: float = 0.2) -> None:
        """Args:
            max_turns: assistant turns an episode may take
            val_seed: seed of the held-out problems
            val_size: held-out problems
            solution_style: the warm start's episodes: tool (call f, then answer) or mixed (every other one
                answers at once with a guess, which the reward never accepts: RL has to prefer the tool)
            tool_reward: the `tool` component of an episode that called f successfully (any x)
        """
        if solution_style not in ("tool", "mixed"):
            raise ValueError(f"solution_style must be tool or mixed, got {solution_style!r}")
        self.max_turns, self.val_seed, self.solution_style = int(max_turns), val_seed, solution_style
        self.tool_reward = float(tool_reward)
        self._val = held_out(_draw, val_seed, val_size, space=8 * 10 * 10)
        self._val_keys = set(self._val)

    def _prompt(self, p: Problem, **meta: Any) -> Prompt:
        a, b, x = p
        return Prompt(text=f"f({x})=?", answer=a * x + b, meta={"a": a, "b": b, "x": x, **meta})

    def train_prompts(self, seed: int = 0, start: int = 0) -> Iterator[Prompt]:
        for index, p in train_stream(_draw, seed, start, self.val_seed, self._val_keys):
            yield self._prompt(p, index=index, split="train")

    def val_prompts(self, n: int) -> list[Prompt]:
        if not 0 <= n <= len(self._val):
            raise ValueError(f"asked for {n} validation prompts; the held-out set has {len(self._val)}")
        return [self._prompt(p, index=i, split="val") for i, p in enumerate(self._val[:n])]

    def make_env(self, prompt: Prompt) -> EpisodeEnv:
        f = secret_function(prompt.meta["a"], prompt.meta["b"])
        return ToolEnv(ToolSet([f], timeout=5.0), max_turns=self.max_turns)

    def score_episode(self, prompt: Prompt, episode: EpisodeEnv) -> dict[str, float | None]:
        x = prompt.meta["x"]
        called = _called_f_with(episode.messages, x)
        final = episode.completion
        answers = _INT.findall(final) if "<tool_call>" not in final else []
        right = bool(answers) and int(answers[-1]) == int(prompt.answer)
        # `tool`: a successful call of f with any x, a shaping reward (as sum_digits' format reward): a tiny model
        # rarely gets a whole episode right at first, but it can be told that calling the tool is the way
        return {"correctness": 1.0 if (right and called) else 0.0,
                "tool": self.tool_reward if _called_f(episode.messages) else 0.0}

    def solution_messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The right episode after the prompt: the call, the tool's answer, the final answer (solution_style mixed:
        every other prompt a direct guess instead, a*x without b, which scores 0)."""
        if self.solution_style == "mixed" and prompt.meta.get("index", 0) % 2:
            return [{"role": "assistant", "content": str(prompt.meta["a"] * prompt.meta["x"])}]
        call = format_tool_call("f", {"x": prompt.meta["x"]}, compact=True)
        return [{"role": "assistant", "content": call},
                {"role": "tool", "name": "f", "content": str(prompt.answer)},
                {"role": "assistant", "content": str(prompt.answer)}]


def _called_f(messages: list[dict[str, Any]]) -> bool:
    """Did an assistant turn call f (any x) and get a result back?"""
    return any(_called_f_with(messages, x) for x in range(10))


def _called_f_with(messages: list[dict[str, Any]], x: int) -> bool:
    """Did an assistant turn call f(x) and get a result back (the following tool message is not an error)?"""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        calls = parse_tool_calls(m["content"])
        results = [r for r in messages[i + 1: i + 1 + len(calls)] if r["role"] == "tool"]
        for call, result in zip(calls, results, strict=False):
            if (call.error is None and call.name == "f" and call.arguments == {"x": x}
                    and not result["content"].startswith("Error:")):
                return True
    return False
