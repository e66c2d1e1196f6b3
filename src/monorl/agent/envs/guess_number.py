"""guess_number: a multi-turn game with feedback. The model guesses a secret integer in [low, high]; after each
guess the environment answers (a user message) ``Higher.``, ``Lower.`` or ``Correct!``. A message-level
environment (`GuessNumberEnv`: ``init(row)`` / ``step(message)``), run through `MessageEnvAdapter`.

- a guess: the last integer of the assistant's text (after any ``<think>...</think>`` block); a turn without one
  gets ``Please answer with one integer between low and high.`` and still counts as a turn.
- reward: ``solved`` 1.0 when the secret is guessed within `max_turns`; ``efficiency`` rewards few turns:
  ``efficiency_reward * (max_turns - turns) / (max_turns - 1)`` when solved (the whole of it on the first guess,
  0 on the last turn), else 0. Binary search solves [1, 100] in at most 7 guesses.
- problems: the secret from a seeded stream; a fixed held-out set (``val_seed``) that training never draws.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

from monorl.agent.env import EpisodeEnv
from monorl.agent.environments import MessageEnvAdapter
from monorl.agent.task import AgentTask
from monorl.tasks.base import Prompt
from monorl.tasks.seeded import held_out, train_stream

_INT = re.compile(r"-?\d+")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def parse_guess(text: str) -> int | None:
    """The last integer of `text` outside a think block, or None."""
    found = _INT.findall(_THINK.sub("", text))
    return int(found[-1]) if found else None


class GuessNumberEnv:
    """The game for one episode (message-level: ``init(row)``, ``step(message)``)."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.secret: int | None = None
        self.guesses: list[int | None] = []
        self.solved_at: int | None = None  # the turn (1-based) of the right guess

    def init(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.secret = int(row["answer"])
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message: dict[str, str]) -> tuple[list[dict[str, str]], float | None, bool]:
        guess = parse_guess(message["content"])
        self.guesses.append(guess)
        if guess is None:
            feedback = f"Please answer with one integer between {self.low} and {self.high}."
        elif guess == self.secret:
            self.solved_at = len(self.guesses)
            return [], 1.0, True
        else:
            feedback = "Higher." if guess < self.secret else "Lower."
        return [{"role": "user", "content": feedback}], None, False


class GuessNumberTask(AgentTask):
    """Guess a secret integer in [low, high] with higher / lower feedback (see the module docstring)."""

    name = "guess_number"
    reward_components = ("solved", "efficiency")

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 8, efficiency_reward: float = 0.5,
                 val_seed: int = 99, val_size: int | None = None) -> None:
        if high - low < 3:
            raise ValueError(f"need high - low >= 3, got low={low}, high={high}")
        if max_turns < 2:
            raise ValueError(f"max_turns must be >= 2, got {max_turns}")
        self.low, self.high, self.max_turns = int(low), int(high), int(max_turns)
        self.efficiency_reward, self.val_seed = float(efficiency_reward), val_seed
        space = self.high - self.low + 1
        self._val = held_out(self._draw, val_seed, val_size or min(16, space // 4), space)
        self._val_keys = set(self._val)

    def _draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def _prompt(self, secret: int, **meta: Any) -> Prompt:
        text = (f"I am thinking of an integer between {self.low} and {self.high}. Guess it: answer with one "
                f"integer. After each guess I will say Higher. or Lower. You have {self.max_turns} guesses.")
        return Prompt(text=text, answer=secret, meta=meta)

    def train_prompts(self, seed: int = 0, start: int = 0) -> Iterator[Prompt]:
        for index, secret in train_stream(self._draw, seed, start, self.val_seed, self._val_keys):
            yield self._prompt(secret, index=index, split="train")

    def val_prompts(self, n: int) -> list[Prompt]:
        if not 0 <= n <= len(self._val):
            raise ValueError(f"asked for {n} validation prompts; the held-out set has {len(self._val)}")
        return [self._prompt(s, index=i, split="val") for i, s in enumerate(self._val[:n])]

    def make_env(self, prompt: Prompt) -> EpisodeEnv:
        return MessageEnvAdapter(GuessNumberEnv(self.low, self.high), max_turns=self.max_turns)

    def score_episode(self, prompt: Prompt, episode: EpisodeEnv) -> dict[str, float | None]:
        game: GuessNumberEnv = episode.environment  # type: ignore[attr-defined]
        if game.solved_at is None:
            return {"solved": 0.0, "efficiency": 0.0}
        bonus = self.efficiency_reward * (self.max_turns - game.solved_at) / (self.max_turns - 1)
        return {"solved": 1.0, "efficiency": bonus}
