"""Tasks whose completions are episodes: `AgentTask` is a `Task` (prompts, validation set) that also makes each
prompt's environment (`make_env`) and scores a finished episode (`score_episode`) rather than one completion
text. `safe_score_episode` is `safe_reward`'s counterpart: a failed environment or a failing score is 0.0 on every
component with an error, never an exception."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from monorl.agent.env import EpisodeEnv
from monorl.tasks.base import Prompt, Task, _components


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

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float | None]:
        raise TypeError(f"{type(self).__name__} is an agent task: it scores whole episodes (score_episode), "
                        "not single completions")

    def tool_schemas(self, episode: EpisodeEnv) -> list[dict[str, Any]] | None:
        """The ``tools=`` to render for this episode (None: none shown)."""
        return episode.tools if self.render_tools and episode.tools else None


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
