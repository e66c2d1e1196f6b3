"""The `dataset` task name (``--task.name dataset``): your data and reward functions as TRL's GRPOTrainer takes
them, ``tools=`` and ``environment_factory=`` included. Without those its completions are single turns
(`DatasetTask`); with them they are episodes (`monorl.agent.dataset_env.AgentDatasetTask`, also named
``agent_dataset``), as TRL turns the same trainer agentic when given tools."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from monorl.tasks.base import Task
from monorl.tasks.dataset import DatasetTask
from monorl.tasks.spec import TaskError

# what the episodes take beyond the dataset task's arguments (meaningless without tools or an environment)
_EPISODE_ONLY = ("max_turns", "system", "tool_timeout", "env_timeout")


def dataset_task(path: str | Path, reward: Any = None, tools: Any = None, environment_factory: Any = None,
                 **args: Any) -> Task:
    """Your dataset and reward functions; given tools or an environment_factory, played as episodes. The
    arguments' descriptions: `AgentDatasetTask` (tools, environment_factory, the episodes' settings) and
    `DatasetTask` (the rest), where ``**args`` go (`kwargs_to`)."""
    if tools is None and environment_factory is None:
        if given := [a for a in _EPISODE_ONLY if a in args]:
            raise TaskError(f"--task.args.{given[0]} applies to episodes: give --task.args.tools or "
                            "--task.args.environment_factory too")
        return DatasetTask(path, reward=reward, **args)
    from monorl.agent.dataset_env import AgentDatasetTask  # the agent package: imported when episodes are asked for

    return AgentDatasetTask(path, reward=reward, tools=tools, environment_factory=environment_factory, **args)


dataset_task.kwargs_to = "monorl.agent.dataset_env:AgentDatasetTask"  # type: ignore[attr-defined]  # for --help
