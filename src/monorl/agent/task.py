"""Tasks whose completions are episodes: `AgentTask` is a `Task` (prompts, validation set) that also makes each
prompt's environment (`make_env`) and scores a finished episode (`score_episode`) rather than one completion
text. `safe_score_episode` / `safe_score_episodes` are `safe_reward` / `safe_score_batch`'s counterparts: a failed
environment or a failing score is 0.0 on every component with an error, never an exception."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from monorl.agent.env import EpisodeEnv
from monorl.agent.render import ChatRenderer
from monorl.tasks.base import ChatTokenizer, Prompt, Task, _components, messages_of


class AgentTask(Task):
    """A `Task` played as multi-turn episodes. `render_tools`: whether the prompt lists the tools' JSON schemas
    (a tiny model's short context may leave them out and name the tool in the question instead).
    `max_turns`: the assistant turns an episode may take."""

    render_tools: bool = True
    max_turns: int = 8

    @abstractmethod
    def make_env(self, prompt: Prompt) -> EpisodeEnv:
        """A fresh environment for one episode of `prompt` (the runner then calls its `start(prompt)`)."""

    @abstractmethod
    def score_episode(self, prompt: Prompt, episode: EpisodeEnv) -> dict[str, float | None]:
        """Reward components of a finished episode (its conversation: `episode.messages`, final answer:
        `episode.completion`, environment reward: `episode.env_reward`, record: `episode.record`)."""

    def score_episodes(self, prompts: Sequence[Prompt], episodes: Sequence[EpisodeEnv],
                       completion_ids: Sequence[Sequence[int]] | None = None,
                       ) -> list[tuple[dict[str, float | None], str | None]]:
        """A batch of finished episodes: `(components, error)` each, as `safe_score_episode` returns them. A task
        whose reward is cheaper batched (TRL-style reward functions) overrides it, keeping those semantics."""
        return [safe_score_episode(self, p, e) for p, e in zip(prompts, episodes, strict=True)]

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float | None]:
        raise TypeError(f"{type(self).__name__} is an agent task: it scores whole episodes (score_episode), "
                        "not single completions")

    def tool_schemas(self, episode: EpisodeEnv) -> list[dict[str, Any]] | None:
        """The ``tools=`` to render for this episode (None: none shown)."""
        return episode.tools if self.render_tools and episode.tools else None

    def render(self, prompt: Prompt, tokenizer: ChatTokenizer) -> str:
        """The text an episode of `prompt` starts from, as the episode runner renders it: the environment's first
        conversation (system prompt, reset()'s observation) with the tool schemas the prompt lists, through
        `ChatRenderer`. The start-up prompt-fit check and the memory plan measure this (a tool schema can take more
        room than the question). An environment that fails to start: the prompt's own messages with its tools."""
        env = self.make_env(prompt)
        first = env.start(prompt)
        messages = messages_of(prompt) if first.done else first.messages
        return ChatRenderer(tokenizer).render(messages, tools=self.tool_schemas(env))


def safe_score_episode(task: AgentTask, prompt: Prompt,
                       episode: EpisodeEnv) -> tuple[dict[str, float | None], str | None]:
    """`task.score_episode`, guarded: an episode whose environment failed, or a score that raises or returns
    anything but the task's components as finite numbers (or None), scores 0.0 on every component, with the
    error as the second element (None when it worked)."""
    zeros: dict[str, float | None] = {k: 0.0 for k in task.reward_components}
    if episode.record.error is not None:
        return zeros, episode.record.error
    try:
        return _components(task, task.score_episode(prompt, episode), "score_episode"), None
    except Exception as e:  # noqa: BLE001 -- a user score can fail in any way; the run goes on
        return zeros, f"{type(e).__name__}: {e}"


def safe_score_episodes(task: AgentTask, prompts: Sequence[Prompt], episodes: Sequence[EpisodeEnv],
                        completion_ids: Sequence[Sequence[int]] | None = None,
                        ) -> list[tuple[dict[str, float | None], str | None]]:
    """`task.score_episodes`, guarded as `safe_score_batch` guards `score_batch`: a call that raises or returns
    anything but one `(components, error)` pair per episode with the task's components scores every episode 0.0."""
    zeros: dict[str, float | None] = {k: 0.0 for k in task.reward_components}
    try:
        out = list(task.score_episodes(prompts, episodes, completion_ids))
        if len(out) != len(episodes):
            raise ValueError(f"score_episodes returned {len(out)} results for {len(episodes)} episodes")
        return [(zeros.copy(), str(err)) if err is not None else (_components(task, vals, "score_episodes"), None)
                for vals, err in out]
    except Exception as e:  # noqa: BLE001 -- as safe_score_episode
        return [(zeros.copy(), f"{type(e).__name__}: {e}") for _ in episodes]
