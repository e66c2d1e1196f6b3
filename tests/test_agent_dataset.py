"""agent_dataset: a dataset played with tools and a TRL-style environment_factory, scored by TRL-style reward
functions that receive environments= (and the environment's own get_reward as a component named after its class)."""

from __future__ import annotations

import json

import pytest

from monorl.agent import format_tool_call
from monorl.agent.dataset_env import AgentDatasetTask
from monorl.agent.task import safe_score_episodes
from monorl.tasks import Prompt, TaskError, load_task

pytest.importorskip("datasets")

ENV_FILE = '''
class Bank:
    """A TRL-style environment: one instance per episode."""

    def __init__(self):
        self.balance = 0

    def reset(self, start, **kwargs):
        self.balance = start
        return None

    def deposit(self, amount: int) -> int:
        """Deposit money.

        Args:
            amount: How much.
        """
        if amount < 0:
            raise ValueError("negative deposit")
        self.balance += amount
        return self.balance

    def get_reward(self) -> float:
        return 1.0 if self.balance == 100 else 0.0


def exact_balance(completions, environments, **kwargs):
    return [1.0 if env.balance == 100 and "100" in c else 0.0 for c, env in zip(completions, environments)]
'''

TOOLS_FILE = '''
def double(x: int) -> int:
    """Double a number.

    Args:
        x: The number.
    """
    return 2 * x
'''


@pytest.fixture()
def task(tmp_path):
    (tmp_path / "bank.py").write_text(ENV_FILE)
    (tmp_path / "my_tools.py").write_text(TOOLS_FILE)
    rows = [{"prompt": f"Bring the balance from {s} to 100.", "start": s, "solution": "100"} for s in (40, 70, 90)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_task("monorl.agent.envs:AgentDatasetTask", path=str(tmp_path / "data.jsonl"),
                     reward=f"{tmp_path / 'bank.py'}:exact_balance", tools=f"{tmp_path / 'my_tools.py'}:double",
                     environment_factory=f"{tmp_path / 'bank.py'}:Bank", test_fraction=0.34, max_turns=4)


def test_episodes_with_environment_and_tools(task):
    assert task.reward_components == ("exact_balance", "Bank")
    prompt = next(task.train_prompts(seed=0))
    start = prompt.meta["columns"]["start"]
    episodes = []
    for turns in ([format_tool_call("double", {"x": 2}) + format_tool_call("deposit", {"amount": 100 - start}),
                   "The balance is 100."],
                  [format_tool_call("deposit", {"amount": -5}), "The balance is 100."],
                  ["I give up"]):
        env = task.make_env(prompt)
        env.start(prompt)
        assert sorted(t["function"]["name"] for t in env.tools) == ["deposit", "double"]
        for text in turns:
            if env.respond(text).done:
                break
        env.finish()
        episodes.append(env)
    assert episodes[0].messages[2]["content"] == "4" and episodes[0].record.tool_failures["deposit"] == 0
    assert "negative deposit" in episodes[1].messages[2]["content"]
    scored = safe_score_episodes(task, [prompt] * 3, episodes)
    assert scored == [({"exact_balance": 1.0, "Bank": 1.0}, None), ({"exact_balance": 0.0, "Bank": 0.0}, None),
                      ({"exact_balance": 0.0, "Bank": 0.0}, None)]


def test_a_failed_environment_scores_zero(task):
    prompt = next(task.train_prompts(seed=0))
    broken = without_column(prompt, "start")
    env = task.make_env(broken)
    assert env.start(broken).done  # reset(start) is missing its argument
    env.finish()
    (scores, err), = safe_score_episodes(task, [broken], [env])
    assert scores == {"exact_balance": 0.0, "Bank": 0.0} and "environment start raised TypeError" in err


def without_column(prompt: Prompt, name: str) -> Prompt:
    columns = {k: v for k, v in prompt.meta["columns"].items() if k != name}
    return Prompt(prompt.text, prompt.answer, {**prompt.meta, "columns": columns})


def test_needs_a_reward_and_tools_or_an_environment(tmp_path):
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "hi", "solution": "1"}) + "\n")
    with pytest.raises(TaskError, match="needs reward functions"):
        AgentDatasetTask(tmp_path / "data.jsonl", tools="python")
    with pytest.raises(TaskError, match="needs tools"):
        AgentDatasetTask(tmp_path / "data.jsonl", reward="format")
    with pytest.raises(TaskError, match="must look like"):
        AgentDatasetTask(tmp_path / "data.jsonl", reward="format", environment_factory="Bank")
