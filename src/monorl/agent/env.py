"""The episode-side interface the episode runner calls, one object per episode:

    env = task.make_env(prompt)                 # an EpisodeEnv
    first = env.start(prompt)                   # TurnResult: the conversation to render (first.messages)
    text = renderer.render(first.messages, tools=env.tools)
    ... decode a turn; the sampled tokens stay as they are ...
    turn = env.respond(assistant_text)          # TurnResult: messages to append, done, reward
    ids = renderer.delta_ids(turn.messages, tools=env.tools, closed=...)   # prefill only these, decode on
    ... until turn.done (or the runner's token budget: env.truncate("length")) ...
    env_reward = env.finish()                   # the environment's reward (None: it gives none)

`start`, `respond` and `finish` never raise: an exception (or a timeout, `env_timeout` seconds) in the
environment's own code ends the episode: `TurnResult(done=True, error=...)`, `record.error` set, truncation
"env_error". Such an episode scores 0.0 on every reward component (`safe_score_episode`, the convention of
`monorl.tasks.base.safe_reward`) and counts in ``episodes/env_failure_ratio``; the runner may also give its
tokens zero loss weight (`record.failed`). Calls block (tools, environments): run them through an
`AgentExecutor` (`executor.submit(env.respond, text)`) and poll the future between decode steps.

`ToolEnv` is the plain case (TRL's ``tools=[fn]``): each turn's ``<tool_call>`` blocks run, their results come
back as ``tool`` messages, and a turn without calls ends the episode. The TRL ``environment_factory`` and the
message-level protocol are in `agent/environments.py`.
"""

from __future__ import annotations

import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from monorl.agent.calls import parse_tool_calls
from monorl.agent.executor import call_with_timeout
from monorl.agent.metrics import EpisodeRecord
from monorl.agent.tools import ToolSet
from monorl.tasks.base import Prompt, messages_of

DEFAULT_ENV_TIMEOUT_S = 30.0


@dataclass
class TurnResult:
    """What an environment says after a turn: `messages` to append (tool results, user / environment messages;
    at `start`, the whole first conversation), whether the episode is `done`, the turn's `reward` if the
    environment gives per-turn rewards, and `error` when the environment failed (then `done`)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    error: str | None = None


def row_of(prompt: Prompt) -> dict[str, Any]:
    """A prompt as a dataset row, the way TRL's ``reset(**row)`` and reward functions see it: the data columns
    (`meta["columns"]`), the other meta fields, ``prompt`` (messages, or the text) and ``answer``."""
    row = {k: v for k, v in prompt.meta.items() if k not in ("columns", "messages")}
    row.update(prompt.meta.get("columns") or {})
    row["prompt"] = prompt.meta.get("messages") or prompt.text
    row.setdefault("answer", prompt.answer)
    return row


def accepted_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of `kwargs` that `fn` takes (all of them when it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


class EpisodeEnv(ABC):
    """One episode's environment (see the module docstring). Subclasses implement `_start` and `_respond`
    (and `_finish` for an end-of-episode reward); the public methods add timing, timeouts, the turn limit and
    turning failures into results."""

    def __init__(self, tools: ToolSet | None = None, max_turns: int | None = None,
                 env_timeout: float | None = DEFAULT_ENV_TIMEOUT_S) -> None:
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 (or None), got {max_turns}")
        self.toolset = tools if tools is not None else ToolSet()
        self.max_turns, self.env_timeout = max_turns, env_timeout
        self.record = EpisodeRecord()
        self.messages: list[dict[str, Any]] = []  # the whole conversation so far, as text
        self.prompt_messages = 0  # how many of `messages` the episode started with
        self.step_rewards: list[float] = []
        self.done = False
        self._finished = False
        self.env_reward: float | None = None

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The JSON schemas to offer in the prompt (``tools=`` of the renderer)."""
        return self.toolset.schemas

    @property
    def completion(self) -> str:
        """The last assistant message's text ("" before the model spoke)."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    @property
    def completions(self) -> list[dict[str, Any]]:
        """What followed the prompt (assistant, tool and environment messages): TRL's conversational completion."""
        return self.messages[self.prompt_messages:]

    # -- the runner's calls -------------------------------------------------------------------------------
    def start(self, prompt: Prompt) -> TurnResult:
        try:
            messages = list(self._start(prompt))
        except Exception as e:  # noqa: BLE001 -- an environment can fail in any way; the run goes on
            return self._fail("start", e)
        self.messages, self.prompt_messages = list(messages), len(messages)
        return TurnResult(messages, done=False)

    def respond(self, assistant_text: str) -> TurnResult:
        if self.done:
            return TurnResult(done=True, error=self.record.error)
        self.record.turns += 1
        self.messages.append({"role": "assistant", "content": assistant_text})
        last_turn = self.max_turns is not None and self.record.turns >= self.max_turns
        try:
            result = self._respond(assistant_text, last_turn)
            if result.reward is not None:
                self.step_rewards.append(float(result.reward))
        except Exception as e:  # noqa: BLE001
            return self._fail("step", e)
        if not result.done and last_turn:  # the model would go on: the turn limit stops it here
            result = TurnResult(done=True, reward=result.reward)
            self.record.truncation = "max_turns"
        self.messages.extend(result.messages)
        self.done = result.done
        return result

    def truncate(self, reason: str = "length") -> None:
        """The runner stopped the episode (its token budget ran out): record why; `finish` still scores it."""
        self.done = True
        if self.record.truncation is None:
            self.record.truncation = reason

    def finish(self) -> float | None:
        """End the episode and return the environment's reward: `_finish`'s, else the sum of the turns' rewards
        (None when the environment gave none). The first call computes it; later calls return it again."""
        self.done = True
        if self.record.error is None and not self._finished:
            self._finished = True
            try:
                reward = self._finish()
                if reward is None and self.step_rewards:
                    reward = sum(self.step_rewards)
                self.env_reward = None if reward is None else float(reward)
            except Exception as e:  # noqa: BLE001
                self._fail("reward", e)
        return self.env_reward

    # -- what subclasses implement ------------------------------------------------------------------------
    @abstractmethod
    def _start(self, prompt: Prompt) -> list[dict[str, Any]]:
        """The first conversation (system / user messages)."""

    @abstractmethod
    def _respond(self, assistant_text: str, last_turn: bool) -> TurnResult:
        """The environment's answer to an assistant turn (`last_turn`: the turn limit ends the episode anyway)."""

    def _finish(self) -> float | None:
        return None

    # -- helpers ------------------------------------------------------------------------------------------
    def call_env(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call the environment's own code with the deadline, counting its time as environment time."""
        start = time.perf_counter()
        try:
            return call_with_timeout(fn, *args, timeout=self.env_timeout, **kwargs)
        finally:
            self.record.env_seconds += time.perf_counter() - start

    def run_tools(self, assistant_text: str, last_turn: bool) -> TurnResult:
        """The turn's tool calls, run in order: their ``tool`` messages; no calls ends the episode. On the last
        turn calls are not run (the episode ends before their results could be read)."""
        calls = parse_tool_calls(assistant_text)
        if not calls:
            return TurnResult(done=True)
        if last_turn:
            return TurnResult(done=False)
        results = [self.toolset.call(c) for c in calls]
        self.record.add_tool_results(results)
        return TurnResult([r.message() for r in results], done=False)

    def _fail(self, what: str, e: BaseException) -> TurnResult:
        kind = "timed out" if isinstance(e, TimeoutError) else f"raised {type(e).__name__}"
        self.record.error = f"environment {what} {kind}: {e}"
        self.record.truncation = "env_error"
        self.done = True
        self.env_reward = None
        return TurnResult(done=True, error=self.record.error)


class ToolEnv(EpisodeEnv):
    """Tools only (TRL's ``tools=[fn]``): the prompt's conversation (a `system` message first, if given), then
    tool calls answered until a turn makes none. The reward comes from the task (`AgentTask.score_episode`)."""

    def __init__(self, tools: ToolSet, system: str | None = None, max_turns: int | None = 8,
                 env_timeout: float | None = DEFAULT_ENV_TIMEOUT_S) -> None:
        super().__init__(tools, max_turns=max_turns, env_timeout=env_timeout)
        self.system = system

    def _start(self, prompt: Prompt) -> list[dict[str, Any]]:
        messages = messages_of(prompt)
        if self.system and not (messages and messages[0]["role"] == "system"):
            messages = [{"role": "system", "content": self.system}, *messages]
        return messages

    def _respond(self, assistant_text: str, last_turn: bool) -> TurnResult:
        return self.run_tools(assistant_text, last_turn)
