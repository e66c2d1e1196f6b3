"""Environments behind EpisodeEnv: TRL's environment_factory convention, message-level environments (sync and
async), failures and hangs in reset / step becoming ended episodes (never exceptions), the turn limit, the
executor, and the episode metrics."""

from __future__ import annotations

import asyncio
import time

import pytest

from monorl.agent import (
    AgentExecutor,
    FactoryEnv,
    MessageEnvAdapter,
    ToolEnv,
    ToolSet,
    environment_of,
    episode_metrics,
    format_tool_call,
    row_of,
)
from monorl.agent.env import EpisodeEnv
from monorl.tasks.base import Prompt

PROMPT = Prompt("Count to three.", answer=3, meta={"columns": {"start": 1, "level": "easy"}, "index": 0})


class CounterEnv:
    """A TRL-style environment: reset(**row), public methods are tools, get_reward() scores the episode."""

    def __init__(self) -> None:
        self.count = 0

    def reset(self, start: int = 0, **kwargs) -> str | None:
        self.count = start
        return f" (the counter is at {start})"

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return 1.0 if self.count == 3 else 0.0

    def _helper(self) -> None:
        raise AssertionError("private methods are not tools")

    @property
    def broken_property(self) -> int:
        raise AssertionError("properties are not evaluated when listing tools")


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    return text.upper()


def test_environment_factory_convention():
    env = FactoryEnv(CounterEnv, tools=[shout])
    first = env.start(PROMPT)
    assert not first.done and first.messages == [{"role": "user", "content": "Count to three. (the counter is at 1)"}]
    assert sorted(t["function"]["name"] for t in env.tools) == ["increment", "shout"]
    calls = format_tool_call("increment", {"step": 2}) + format_tool_call("shout", {"text": "a"})
    turn = env.respond("Adding. " + calls)
    assert [m["content"] for m in turn.messages] == ["3", "A"] and not turn.done
    assert env.respond("Done: 3.").done
    assert env.finish() == 1.0 and env.env_reward == 1.0
    assert environment_of([env])[0] is env.environment and env.environment.count == 3
    assert env.record.turns == 2 and env.record.tool_calls == {"increment": 1, "shout": 1}
    assert env.completion == "Done: 3." and [m["role"] for m in env.completions] == ["assistant", "tool", "tool",
                                                                                      "assistant"]


def test_row_of_passes_the_columns():
    row = row_of(PROMPT)
    assert row["start"] == 1 and row["level"] == "easy" and row["prompt"] == "Count to three." and row["answer"] == 3


class FailingReset(CounterEnv):
    def reset(self, **kwargs) -> str | None:
        raise ConnectionError("server down")


class BadObservation(CounterEnv):
    def reset(self, **kwargs) -> str | None:
        return 42  # type: ignore[return-value]


class FailingReward(CounterEnv):
    def get_reward(self) -> float:
        raise ValueError("no score")


@pytest.mark.parametrize("cls,error", [(FailingReset, "environment start raised ConnectionError: server down"),
                                       (BadObservation, "reset() returned int")])
def test_env_failure_in_reset_ends_the_episode(cls, error):
    env = FactoryEnv(cls)
    first = env.start(PROMPT)
    assert first.done and error in first.error and env.record.failed and env.record.truncation == "env_error"
    assert env.respond("anything").done  # a runner that goes on anyway gets an ended episode
    assert env.finish() is None


class TextReward(CounterEnv):
    def get_reward(self) -> float:
        return "high"  # type: ignore[return-value]


class CountedReward(CounterEnv):
    calls = 0

    def get_reward(self) -> float:
        CountedReward.calls += 1
        return 2.0


def test_env_failure_in_the_reward():
    for cls, error in [(FailingReward, "environment reward raised ValueError: no score"),
                       (TextReward, "environment reward raised ValueError: could not convert")]:
        env = FactoryEnv(cls)
        env.start(PROMPT)
        env.respond("no calls")
        assert env.finish() is None and error in env.record.error
    env = FactoryEnv(CountedReward)
    env.start(PROMPT)
    env.respond("no calls")
    assert env.finish() == env.finish() == 2.0 and CountedReward.calls == 1


class EchoGame:
    """A message-level environment (sync): init(row) -> messages, step(message) -> (messages, reward, done)."""

    def __init__(self, fail_at: int | None = None, hang_at: int | None = None) -> None:
        self.turn, self.fail_at, self.hang_at = 0, fail_at, hang_at

    def init(self, row):
        return [{"role": "system", "content": "Echo game."}, {"role": "user", "content": row["prompt"]}]

    def step(self, message):
        self.turn += 1
        if self.turn == self.fail_at:
            raise KeyError("bad state")
        if self.hang_at == self.turn:
            time.sleep(30)
        done = "stop" in message["content"]
        return ([] if done else [{"role": "user", "content": f"you said {message['content']}"}]), 0.5, done


class AsyncEchoGame(EchoGame):
    async def init(self, row):
        await asyncio.sleep(0.01)
        return super().init(row)

    async def step(self, message):
        await asyncio.sleep(0.01)
        if self.turn + 1 == self.hang_at:
            await asyncio.sleep(3600)
        return super().step(message)


@pytest.mark.parametrize("game_cls", [EchoGame, AsyncEchoGame])
def test_message_env(game_cls):
    env = MessageEnvAdapter(game_cls())
    assert [m["role"] for m in env.start(PROMPT).messages] == ["system", "user"]
    turn = env.respond("hello")
    assert turn.messages == [{"role": "user", "content": "you said hello"}] and turn.reward == 0.5 and not turn.done
    assert env.respond("stop now").done
    assert env.finish() == 1.0  # the sum of the steps' rewards
    assert env.record.turns == 2 and env.record.env_seconds > 0


@pytest.mark.parametrize("game_cls", [EchoGame, AsyncEchoGame])
def test_message_env_failures(game_cls):
    env = MessageEnvAdapter(game_cls(fail_at=2))
    env.start(PROMPT)
    assert not env.respond("one").done
    turn = env.respond("two")
    assert turn.done and "environment step raised KeyError" in turn.error and env.finish() is None
    env = MessageEnvAdapter(game_cls(hang_at=1), env_timeout=0.3)
    env.start(PROMPT)
    turn = env.respond("one")
    assert turn.done and "environment step timed out" in turn.error
    with pytest.raises(TypeError, match="has no init"):
        MessageEnvAdapter(object())


def test_turn_limit_truncates():
    env = MessageEnvAdapter(EchoGame(), max_turns=2)
    env.start(PROMPT)
    assert not env.respond("a").done
    last = env.respond("b")
    assert last.done and last.messages == [] and env.record.truncation == "max_turns"
    tools = ToolEnv(ToolSet([shout]), max_turns=1)
    tools.start(PROMPT)
    turn = tools.respond(format_tool_call("shout", {"text": "x"}))
    assert turn.done and tools.record.tool_calls == {} and tools.record.truncation == "max_turns"
    env = ToolEnv(ToolSet([shout]))
    env.start(PROMPT)
    env.truncate("length")
    assert env.done and env.record.truncation == "length"


def test_executor_runs_episodes_concurrently():
    def slow_tool(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "ok"

    envs: list[EpisodeEnv] = [ToolEnv(ToolSet([slow_tool])) for _ in range(8)]
    with AgentExecutor(max_workers=8) as ex:
        for e in envs:
            assert ex.submit(e.start, PROMPT).result().messages[0]["role"] == "user"
        futures = [ex.submit(e.respond, format_tool_call("slow_tool", {"seconds": 0.3})) for e in envs]
        polls = 0
        while not all(f.done() for f in futures):  # the runner polls between decode steps
            polls += 1
            ex.wait_any([f for f in futures if not f.done()], timeout=0.05)
        assert all(f.result().messages[0]["content"] == "ok" for f in futures)
    assert episode_metrics([e.record for e in envs])["tools/slow_tool/calls"] == 1.0


def test_episode_metrics_names():
    env = MessageEnvAdapter(EchoGame(fail_at=1))
    env.start(PROMPT)
    env.respond("x")
    ok = ToolEnv(ToolSet([shout]))
    ok.start(PROMPT)
    ok.respond(format_tool_call("shout", {"text": "a"}) + format_tool_call("nope", {}))
    ok.respond("done")
    m = episode_metrics([env.record, ok.record])
    assert m["tools/call_frequency"] == 1.0 and m["tools/failure_frequency"] == 0.5
    assert m["episodes/env_failure_ratio"] == 0.5 and m["episodes/truncated_env_error_ratio"] == 0.5
    assert m["episodes/turns_mean"] == 1.5 and m["tools/unknown_tool/failure_frequency"] == 1.0
    assert episode_metrics([]) == {}


def test_blocking_on_the_agent_loop_from_inside_it_is_an_error_not_a_deadlock():
    async def tool_coro() -> int:
        return 1

    class CallsSyncInsideAsync(EchoGame):
        async def step(self, message):
            from monorl.agent.executor import call_with_timeout

            call_with_timeout(tool_coro, timeout=1.0)  # blocks the loop it runs on: refused
            return [], 1.0, True

    env = MessageEnvAdapter(CallsSyncInsideAsync(), env_timeout=5.0)
    env.start(PROMPT)
    turn = env.respond("x")
    assert turn.done and "RuntimeError" in turn.error and "await it instead" in turn.error
