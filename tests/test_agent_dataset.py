"""The dataset task given tools / a TRL-style environment_factory (`--task.name dataset`, or `agent_dataset`): played
as episodes, scored by TRL-style reward functions that receive environments= (and the environment's own get_reward as
a component named after its class); a prompt whose tool schemas do not fit the context is refused at start-up."""

from __future__ import annotations

import json
import re

import pytest
import torch

from monorl.agent import format_tool_call
from monorl.agent.dataset_env import AgentDatasetTask
from monorl.agent.task import safe_score_episodes
from monorl.task_registry import load_task
from monorl.tasks import Prompt, TaskError

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
    return load_task("dataset", path=str(tmp_path / "data.jsonl"),
                     reward=f"{tmp_path / 'bank.py'}:exact_balance", tools=f"{tmp_path / 'my_tools.py'}:double",
                     environment_factory=f"{tmp_path / 'bank.py'}:Bank", test_fraction=0.34, max_turns=4)


def test_episodes_with_environment_and_tools(task):
    assert isinstance(task, AgentDatasetTask)  # --task.name dataset with tools: the agent_dataset task
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
    with pytest.raises(TaskError, match="need reward functions"):
        AgentDatasetTask(tmp_path / "data.jsonl", tools="python")
    with pytest.raises(TaskError, match="needs tools"):
        AgentDatasetTask(tmp_path / "data.jsonl", reward="format")
    with pytest.raises(TaskError, match="must look like"):
        AgentDatasetTask(tmp_path / "data.jsonl", reward="format", environment_factory="Bank")


WEATHER_FILE = '''
def weather(location: str) -> str:
    """Get the current weather in a given location.

    Args:
        location: The city and state, e.g. San Francisco, CA.
    """
    return "Sunny, 21 degrees"
'''


def _weather_run(tmp_path, **args):
    """A cut-down tiny run of the dataset task with TRL's get_weather-style tool, `args` added to its task args."""
    from tests.conftest import digits_cfg

    (tmp_path / "tools.py").write_text(WEATHER_FILE)
    rows = [{"prompt": f"Weather in town {i}?", "solution": str(i)} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = digits_cfg(tmp_path, steps=1)
    cfg.task.name = "dataset"
    cfg.task.args = {"path": str(tmp_path / "data.jsonl"), "reward": "format",
                     "tools": f"{tmp_path / 'tools.py'}:weather", **args}
    cfg.validation.num_prompts = 0
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 2, 2, 8
    cfg.checkpoint.final = False
    return cfg


def test_a_tool_schema_that_does_not_fit_is_refused_at_start_up(tmp_path, capsys):
    """The tiny preset's 128-token context cannot hold the weather tool's JSON schema: one line at start-up naming
    the prompt as the episode renders it and the max_model_len to raise, not a run of empty episodes."""
    from monorl.cli import main

    cfg = _weather_run(tmp_path)
    args = [f"--task.args.{k}={v}" for k, v in cfg.task.args.items()]
    code = main(["train", "--device", "cpu", "--steps", "1", "--warm_start.steps", "0", "--validation.num_prompts",
                 "0", "--rollout.max_new_tokens", "8", "--task.name", "dataset", *args, "--run_dir",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the datasets library's progress bars
    assert code == 2, err
    m = re.fullmatch(r"monorl: error: generator.max_model_len=128 fits none of the first 32 training prompts: the "
                     r"shortest \(as its episode starts: tool schemas and system prompt included\) is (\d+) tokens "
                     r"and 8 new tokens must fit after it; raise generator.max_model_len to at least (\d+) or lower "
                     r"max_new_tokens", err)
    assert m and int(m.group(2)) == int(m.group(1)) + 8, err
    assert not (tmp_path / "run").exists()


def test_the_memory_plan_counts_the_tool_schemas(tmp_path):
    """With room, the longest prompt the memory plan sizes packs with is the episode's, its schema included."""
    from monorl.agent.schema import function_schema
    from monorl.assembly import build_run

    cfg = _weather_run(tmp_path)
    cfg.generator.max_model_len = 512
    spec = build_run(cfg, torch.device("cpu"))
    schema = json.dumps(function_schema(spec.task.tool_fns[0]), ensure_ascii=False)
    # one token a character (the tiny preset's tokenizer): the schema alone is longer than the 128-token context
    assert spec.max_prompt_tokens > len(schema) > 128
    assert spec.plan is not None


def test_dataset_task_with_tools_trains_on_episodes(tmp_path):
    """`--task.name dataset --task.args.tools FILE.py:fn` (as a TRL user passes tools=): the run plays episodes."""
    from monorl.run.grpo import GRPORun

    cfg = _weather_run(tmp_path, max_turns=2)
    cfg.generator.max_model_len = 512
    cfg.samples_per_step = 4
    result = GRPORun(cfg, progress=False).run()
    assert len(result.steps) == 1 and "episodes/turns_mean" in result.steps[0]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all("episode" in s["extra"] for s in samples)


def test_episode_settings_without_tools_are_refused(tmp_path):
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "hi", "solution": "1"}) + "\n")
    with pytest.raises(TaskError, match="max_turns applies to episodes: give --task.args.tools"):
        load_task("dataset", path=str(tmp_path / "data.jsonl"), reward="format", max_turns=3)
    with pytest.raises(TaskError, match="no argument 'tool'.*tools, environment_factory"):
        load_task("dataset", path=str(tmp_path / "data.jsonl"), reward="format", tool="x.py:f")


@pytest.mark.parametrize("name", ["dataset", "agent_dataset"])
def test_help_describes_every_argument_the_task_takes(name, capsys):
    """`--task.name X --help`: the episode arguments and the dataset arguments they pass on, each described."""
    from monorl.cli import run_verb

    with pytest.raises(SystemExit):
        run_verb("train", ["--task.name", name, "--help"])
    out = capsys.readouterr().out
    lines = {m.group(1): m.group(2).strip() for m in re.finditer(r"^  --task\.args\.(\w+) +(.*?)\((?:default: "
                                                                   r".*|required|this config: .*)\)$", out, re.M)}
    assert {"path", "reward", "tools", "environment_factory", "max_turns", "system", "test_fraction", "test_path",
            "prompt_column", "reward_weights", "instruction"} <= set(lines), sorted(lines)
    assert all(lines.values()), [k for k, v in lines.items() if not v]
    assert "TRL's tools=" in lines["tools"] and "share of `path`'s rows" in lines["test_fraction"]


def test_an_episode_that_overflows_is_cut_with_one_warning_naming_it_once(tmp_path, caplog):
    """A prompt past the start-up check's sample that leaves no room: a logged skip, its episode named once."""
    from monorl.generate import Generator, GeneratorConfig
    from monorl.generate.sampling import SamplingParams
    from monorl.model.config import model_shape
    from monorl.model.decoder import build_model
    from monorl.model.tokenizer import CharTokenizer
    from monorl.rl.rollouts.episodes import EpisodeRunner

    cfg = _weather_run(tmp_path)
    task = load_task("dataset", **cfg.task.args)
    tok = CharTokenizer()
    gen = Generator(build_model(model_shape("tiny"), "cpu", torch.float32, seed=0),
                    GeneratorConfig(max_num_seqs=4, max_model_len=128, block_size=4), tokenizer=tok)
    runner = EpisodeRunner(gen, tok, task, max_len=128)
    try:
        with caplog.at_level("WARNING", logger="monorl"):
            (played,), = runner.play([next(task.train_prompts(seed=0))], SamplingParams(max_new_tokens=8, seed=0), 1)
    finally:
        runner.close()
    assert played[1].truncation == "context"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].count("request (0, 0)") == 1, warnings
    assert "leaves no room in max_tokens 128" in warnings[0] and "generator.max_model_len" in warnings[0]
