"""Two ways to bring an environment, both behind `EpisodeEnv`:

- `FactoryEnv`: TRL's ``environment_factory`` (GRPOTrainer, TRL 1.16). A class (or any factory), one instance per
  episode. ``reset(**row)`` (the dataset row's columns; only those it names unless it takes ``**kwargs``) returns
  None or a string, appended to the last user message, as TRL does. Its public methods (not ``reset`` /
  ``get_reward``, no leading ``_``) are the episode's tools, beside any standalone ones, bound to that instance.
  A ``get_reward()`` method, if any, is the episode's environment reward (sync or async). Reward functions get
  the instances as ``environments=`` (`environment_of`).
- `MessageEnvAdapter`: a message-level environment (TorchTitan RL's ``MessageEnv`` shape): ``init(row) ->
  messages`` and ``step(assistant_message) -> (new_messages, reward, done)`` (a tuple, or an object with
  ``messages`` / ``next_messages``, ``reward``, ``done`` / ``episode_done``), each sync or ``async def``. The
  episode's environment reward is the sum of its steps' rewards.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from monorl.agent.content import flat_message, is_content_parts
from monorl.agent.env import DEFAULT_ENV_TIMEOUT_S, EpisodeEnv, TurnResult, accepted_kwargs, row_of
from monorl.agent.tools import Tool, ToolSet
from monorl.tasks.base import Prompt, messages_of

_NOT_TOOLS = ("reset", "get_reward")


def environment_methods(instance: Any) -> list[Callable[..., Any]]:
    """An environment instance's tools, as TRL lists them: the public functions of its class (looked up on the
    class, so properties are not evaluated), bound to the instance."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in _NOT_TOOLS and not name.startswith("_")]


class FactoryEnv(EpisodeEnv):
    """One episode of a TRL-style environment class (see the module docstring). The instance is made in
    `start` (under the environment timeout) and kept as `environment` for the reward functions."""

    def __init__(self, factory: Callable[[], Any], tools: list[Callable[..., Any] | Tool] | None = None,
                 max_turns: int | None = 8, env_timeout: float | None = DEFAULT_ENV_TIMEOUT_S,
                 tool_timeout: float = 10.0, max_result_chars: int = 4096, system: str | None = None) -> None:
        super().__init__(ToolSet(tools or [], timeout=tool_timeout), max_turns=max_turns, env_timeout=env_timeout)
        self.factory, self.standalone = factory, list(tools or [])
        self.tool_timeout, self.max_result_chars, self.system = tool_timeout, max_result_chars, system
        self.environment: Any = None

    def _start(self, prompt: Prompt) -> list[dict[str, Any]]:
        self.environment = self.call_env(self.factory)
        reset = getattr(self.environment, "reset", None)
        if not callable(reset):
            raise TypeError(f"{type(self.environment).__name__} has no reset() method (TRL's environment_factory "
                            "contract)")
        self.toolset = ToolSet([*self.standalone, *environment_methods(self.environment)], timeout=self.tool_timeout,
                               max_result_chars=self.max_result_chars)
        observation = self.call_env(reset, **accepted_kwargs(reset, row_of(prompt)))
        messages = messages_of(prompt)
        if self.system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}, *messages]
        if observation is not None:
            if not isinstance(observation, str):
                raise TypeError(f"reset() returned {type(observation).__name__}; expected None or a string")
            last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
            if last_user is None:
                messages.append({"role": "user", "content": observation})
            else:
                messages[last_user] = {**messages[last_user], "content": messages[last_user]["content"] + observation}
        return messages

    def _respond(self, assistant_text: str, last_turn: bool) -> TurnResult:
        return self.run_tools(assistant_text, last_turn)

    def _finish(self) -> float | None:
        get_reward = getattr(self.environment, "get_reward", None)
        return None if get_reward is None else self.call_env(get_reward)


def environment_of(episodes: list[EpisodeEnv]) -> list[Any]:
    """The TRL ``environments=`` argument of reward functions: each episode's environment instance (None for an
    episode without one)."""
    return [getattr(e, "environment", None) for e in episodes]


class MessageEnvAdapter(EpisodeEnv):
    """A message-level environment (``init(row)``, ``step(message)``; see the module docstring)."""

    def __init__(self, env: Any, tools: ToolSet | None = None, max_turns: int | None = 8,
                 env_timeout: float | None = DEFAULT_ENV_TIMEOUT_S) -> None:
        for method in ("init", "step"):
            if not callable(getattr(env, method, None)):
                raise TypeError(f"{type(env).__name__} has no {method}() method (a message environment needs "
                                "init(row) -> messages and step(message) -> (messages, reward, done))")
        super().__init__(tools, max_turns=max_turns, env_timeout=env_timeout)
        self.environment = env

    def _start(self, prompt: Prompt) -> list[dict[str, Any]]:
        messages = self.call_env(self.environment.init, row_of(prompt))
        return _check_messages(messages, "init")

    def _respond(self, assistant_text: str, last_turn: bool) -> TurnResult:
        out = self.call_env(self.environment.step, {"role": "assistant", "content": assistant_text})
        if isinstance(out, tuple):
            if len(out) != 3:
                raise TypeError(f"step() returned a tuple of {len(out)}; expected (messages, reward, done)")
            messages, reward, done = out
        else:
            messages = getattr(out, "messages", getattr(out, "next_messages", None))
            reward = getattr(out, "reward", None)
            done = getattr(out, "done", getattr(out, "episode_done", None))
            if messages is None or done is None:
                raise TypeError(f"step() returned {type(out).__name__}; expected (messages, reward, done)")
        messages = _check_messages(messages or [], "step")
        if reward is not None:
            reward = float(reward)
        return TurnResult(messages, done=bool(done) or not messages, reward=reward)


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """A message-level environment's messages; content is text or a list of content parts (images: TRL's
    convention, `agent.content`)."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str) or is_content_parts(m.get("content"))) for m in messages):
        raise TypeError(f"{where}() must return a list of {{'role', 'content'}} messages, got {str(messages)[:80]!r}")
    return [flat_message(dict(m)) for m in messages]
