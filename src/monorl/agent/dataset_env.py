"""Your own data, tools and environment, the way TRL's GRPOTrainer takes them (``tools=[fn]``,
``environment_factory=Cls``, reward functions): the dataset task's data and reward functions
(`monorl.tasks.dataset`), played as episodes.

    load_task("dataset", path="data.jsonl", reward="accuracy",
              tools="python my_tools.py:lookup", environment_factory="my_env.py:Counter")

(``dataset`` returns this task when given tools or an environment_factory; ``agent_dataset`` names it directly.)

- ``tools``: a `load_tools` spec (``"FILE.py:fn1,fn2"``, ``"module:fn"``, ``"python"``, several separated by
  spaces), offered in every episode.
- ``environment_factory``: ``"FILE.py:Class"`` / ``"module:Class"`` (or a callable): one instance per episode,
  ``reset(**row)``, its public methods as tools, ``get_reward()`` (if it has one) a reward component named after
  the class (TRL's convention); see `agent/environments.py`.
- reward functions: as the dataset task calls them, once per batch of episodes, plus ``environments=`` (each
  episode's instance, None without a factory). ``completions`` holds each episode's final assistant text (for
  chat prompts ``[{"role": "assistant", "content": ...}]``); TRL passes the whole multi-turn completion there,
  whose last message is the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from monorl.agent.env import EpisodeEnv, ToolEnv
from monorl.agent.environments import FactoryEnv
from monorl.agent.task import AgentTask
from monorl.agent.tool_specs import load_tools
from monorl.agent.tools import ToolSet
from monorl.tasks.base import Prompt
from monorl.tasks.dataset import DatasetTask

_EPISODE_ARGS = ("environments", "env_rewards")  # what episodes add to the reward functions' arguments


class _EpisodeRewards(DatasetTask):
    """The dataset task, whose reward functions may also name the episode arguments."""

    def _check_arguments(self) -> None:
        self.columns = [*self.columns, *_EPISODE_ARGS]
        try:
            super()._check_arguments()
        finally:
            self.columns = [c for c in self.columns if c not in _EPISODE_ARGS]


def _factory(spec: Any) -> Callable[[], Any]:
    if callable(spec):
        return spec
    from monorl.tasks.spec import TaskError, import_object

    if not isinstance(spec, str) or ":" not in spec:
        raise TaskError(f"environment_factory {spec!r} must look like 'FILE.py:Class' or 'module:Class'")
    obj = import_object(spec, "environment_factory")
    if not callable(obj):
        raise TaskError(f"environment_factory {spec!r} names a {type(obj).__name__}, not a class or factory")
    return obj


def _env_reward_fn(name: str) -> Callable[..., list[float | None]]:
    def env_reward(env_rewards: list[float | None], **kwargs: Any) -> list[float | None]:
        return list(env_rewards)

    env_reward.__name__ = name
    return env_reward


class AgentDatasetTask(AgentTask):
    """A dataset played as tool / environment episodes (see the module docstring): ``--task.name dataset`` given
    tools or an environment_factory (or ``agent_dataset``). Other keyword arguments (``test_path``,
    ``test_fraction``, ``prompt_column``, ``reward_weights``, ...) are the dataset task's."""

    name = "agent_dataset"
    kwargs_to = DatasetTask  # where **dataset_args go (`task_parameters`: --help and the unknown-argument check)

    def __init__(self, path: str | Path, reward: Any = None, tools: Any = None, environment_factory: Any = None,
                 max_turns: int = 8, system: str | None = None, tool_timeout: float = 10.0,
                 env_timeout: float = 30.0, **dataset_args: Any) -> None:
        """Args:
            tools: tool functions offered in every episode, their JSON schemas in the prompt: FILE.py:fn1,fn2 or
                module:fn (TRL's tools=), or python (the sandboxed interpreter); several separated by spaces. The
                completions are then multi-turn episodes
            environment_factory: FILE.py:Class or module:Class, one instance per episode (TRL's
                environment_factory=): reset(**row), its public methods as tools, get_reward() a reward component.
                The completions are then multi-turn episodes
            max_turns: assistant turns an episode may take (with tools or an environment_factory)
            system: a system message opening every episode (with tools or an environment_factory)
            tool_timeout: seconds a tool call may take before it fails (with tools or an environment_factory)
            env_timeout: seconds the environment's reset / get_reward may take (with an environment_factory)
        """
        from monorl.tasks.spec import TaskError

        self.tool_fns = load_tools(tools) if tools else []
        self.factory = _factory(environment_factory) if environment_factory is not None else None
        fns = [] if reward is None else (list(reward) if isinstance(reward, list | tuple) else
                                         [s.strip() for s in str(reward).split(",") if s.strip()]
                                         if isinstance(reward, str) else [reward])
        try:  # one instance up front, as TRL makes one: to know its class and whether it owns a reward
            probe = self.factory() if self.factory is not None else None
        except Exception as e:
            raise TaskError(f"environment_factory {environment_factory!r} failed: {type(e).__name__}: {e}") from None
        if probe is not None and callable(getattr(probe, "get_reward", None)):
            fns.append(_env_reward_fn(type(probe).__name__))
        if not fns:
            raise TaskError("the dataset task's episodes need reward functions (reward=...) or an "
                            "environment_factory whose class has get_reward()")
        if probe is None and not self.tool_fns:
            raise TaskError("agent_dataset needs tools=... or environment_factory=... (without them: --task.name "
                            "dataset)")
        self.data = _EpisodeRewards(path, reward=fns, **dataset_args)
        self.reward_components, self.reward_weights = self.data.reward_components, self.data.reward_weights
        self.max_turns, self.system = int(max_turns), system
        self.tool_timeout, self.env_timeout = tool_timeout, env_timeout

    def train_prompts(self, seed: int = 0, start: int = 0) -> Iterator[Prompt]:
        return self.data.train_prompts(seed, start)

    def val_prompts(self, n: int) -> list[Prompt]:
        return self.data.val_prompts(n)

    def make_env(self, prompt: Prompt) -> EpisodeEnv:
        if self.factory is not None:
            return FactoryEnv(self.factory, tools=self.tool_fns, max_turns=self.max_turns,
                              env_timeout=self.env_timeout, tool_timeout=self.tool_timeout, system=self.system)
        return ToolEnv(ToolSet(self.tool_fns, timeout=self.tool_timeout), system=self.system,
                       max_turns=self.max_turns, env_timeout=self.env_timeout)

    def score_episodes(self, prompts: Sequence[Prompt], episodes: Sequence[EpisodeEnv],
                       completion_ids: Sequence[Sequence[int]] | None = None,
                       ) -> list[tuple[dict[str, float | None], str | None]]:
        """Every reward function once over a batch of finished episodes (TRL's convention), with
        ``environments=`` and the environments' rewards; `(components, error)` per episode. A failed
        environment's episode scores 0.0 on every component with its error."""
        extended = [Prompt(p.text, p.answer, {**p.meta, "columns": {
            **(p.meta.get("columns") or {}), "environments": getattr(e, "environment", None),
            "env_rewards": e.env_reward}}) for p, e in zip(prompts, episodes, strict=True)]
        ids = [list(c) for c in completion_ids] if completion_ids is not None else [[] for _ in episodes]
        scored = self.data.score_batch(extended, [e.completion for e in episodes], ids)
        zeros = {k: 0.0 for k in self.reward_components}
        return [(zeros.copy(), e.record.error) if e.record.error is not None else s
                for s, e in zip(scored, episodes, strict=True)]

    def score_episode(self, prompt: Prompt, episode: EpisodeEnv) -> dict[str, float | None]:
        components, error = self.score_episodes([prompt], [episode])[0]
        if error is not None:
            raise RuntimeError(error)
        return components
