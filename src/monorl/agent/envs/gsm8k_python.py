"""gsm8k_python: GSM8K with the sandboxed ``python`` tool. The data are read as `monorl.tasks.gsm8k` reads them
(a JSONL or Parquet file of ``question`` / ``answer`` records, or a ``data_dir`` with ``train`` / ``test`` files);
the model may run Python (`agent/sandbox.py`) any number of times within `max_turns`, then answers in
``\\boxed{}``. ``accuracy`` is graded by math-verify against the number after the reference solution's ``####``
(`monorl.tasks.rewards.accuracy`, the dataset task's ``accuracy`` reward); None when the gold does not parse.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from monorl.agent.env import EpisodeEnv, ToolEnv
from monorl.agent.sandbox import make_python_tool
from monorl.agent.task import AgentTask
from monorl.agent.tools import ToolSet
from monorl.tasks.base import Prompt
from monorl.tasks.gsm8k import Gsm8kTask
from monorl.tasks.rewards import accuracy

INSTRUCTION = ("Solve the problem. You may run Python with the python tool to compute; the tool returns what the "
               "program prints. Put your final answer within \\boxed{}.")


class Gsm8kPythonTask(AgentTask):
    """GSM8K with a Python tool; see the module docstring. ``python_timeout`` (seconds a program may run) and
    ``python_memory_mb`` set the sandbox's limits; ``python_isolation`` is its `isolation` ("auto", "required":
    refuse to start without namespace isolation, or "off")."""

    name = "gsm8k_python"
    reward_components = ("accuracy",)

    def __init__(self, train_path: str | Path | None = None, test_path: str | Path | None = None,
                 data_dir: str | Path | None = None, max_turns: int = 4, python_timeout: float = 10.0,
                 python_memory_mb: int = 1024, system: str | None = None, python_isolation: str = "auto") -> None:
        self.data = Gsm8kTask(train_path=train_path, test_path=test_path, data_dir=data_dir)
        self.max_turns = int(max_turns)
        self.system = system
        self.python = make_python_tool(timeout_s=python_timeout, memory_mb=python_memory_mb,
                                       isolation=python_isolation)

    def _prompt(self, p: Prompt) -> Prompt:
        return Prompt(f"{p.meta['question'].strip()}\n\n{INSTRUCTION}", p.answer, dict(p.meta))

    def train_prompts(self, seed: int = 0, start: int = 0) -> Iterator[Prompt]:
        for p in self.data.train_prompts(seed, start):
            yield self._prompt(p)

    def val_prompts(self, n: int) -> list[Prompt]:
        return [self._prompt(p) for p in self.data.val_prompts(n)]

    def make_env(self, prompt: Prompt) -> EpisodeEnv:
        return ToolEnv(ToolSet([self.python]), system=self.system, max_turns=self.max_turns)

    def score_episode(self, prompt: Prompt, episode: EpisodeEnv) -> dict[str, float | None]:
        (value,) = accuracy([prompt.text], [episode.completion], [[]], solution=[prompt.meta["solution"]])
        return {"accuracy": value}
