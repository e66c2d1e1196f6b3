"""Tasks: prompt sources + reward functions (single-turn; the agent tasks are `monorl.agent`'s). A task is loaded by
name or ``module:object`` spec with `monorl.task_registry.load_task`."""

from __future__ import annotations

from monorl.tasks.arith import ArithTask
from monorl.tasks.base import Prompt, Task, TaskDataNotFound, safe_reward
from monorl.tasks.dataset import DatasetTask
from monorl.tasks.gsm8k import Gsm8kTask
from monorl.tasks.spec import DatasetNotFound, TaskError, import_object, task_parameters
from monorl.tasks.sum_digits import SumDigitsTask

__all__ = ["ArithTask", "DatasetNotFound", "DatasetTask", "Gsm8kTask", "Prompt", "SumDigitsTask", "Task",
           "TaskDataNotFound", "TaskError", "import_object", "safe_reward", "task_parameters"]
