"""The task registry: a task from a built-in name (the single-turn tasks of `monorl.tasks`, the agent tasks of
`monorl.agent.envs`, the `dataset` task that is either) or a ``module:object`` spec. Above both packages, so that
`monorl.tasks` never imports the agent: `load_task("sum_digits")`, `load_task("gsm8k", data_dir=...)`, a user task
as `load_task("my_pkg.my_mod:MyTask")` / `load_task("path/to/file.py:make_task", size=3)`; your own data with
plain reward functions: `load_task("dataset", path="data.jsonl", reward="accuracy,my_rewards.py:fn")` (with
`tools=` or `environment_factory=`: played as episodes)."""

from __future__ import annotations

from typing import Any

from monorl.agent.dataset_entry import dataset_task
from monorl.tasks.arith import ArithTask
from monorl.tasks.base import Task
from monorl.tasks.count_squares import CountSquaresTask
from monorl.tasks.gsm8k import Gsm8kTask
from monorl.tasks.spec import TaskError, construct_task, import_object
from monorl.tasks.sum_digits import SumDigitsTask

# a class, or a factory that returns a Task (`dataset`: a DatasetTask, or with tools an AgentDatasetTask)
BUILTIN_TASKS: dict[str, Any] = {"sum_digits": SumDigitsTask, "gsm8k": Gsm8kTask, "dataset": dataset_task,
                                 "arith": ArithTask, "count_squares": CountSquaresTask}


def load_task(spec: str, **kwargs: Any) -> Task:
    """A task from a built-in name or ``module:object``.

    ``object`` (a dotted attribute path inside the module) may be a `Task` instance (then no kwargs), a `Task`
    subclass (called with kwargs), or a factory (called with kwargs) that returns a `Task`. ``module`` may be an
    importable module name or a path to a ``.py`` file.
    """
    obj = task_object(spec)
    if isinstance(obj, Task):
        if kwargs:
            raise TaskError(f"task spec {spec!r} names a Task instance; it takes no arguments, got {sorted(kwargs)}")
        return obj
    task = construct_task(obj, kwargs, spec)
    if not isinstance(task, Task):
        raise TaskError(f"task factory {spec!r} returned {type(task).__name__}, not a monorl.tasks.Task")
    return task


def task_object(spec: str) -> Any:
    """What a task spec names, not yet called: a built-in's class, or the module's `Task` instance, `Task`
    subclass or factory."""
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]
    if ":" not in spec:
        from monorl.agent.envs import AGENT_TASKS  # agent tasks (tools, environments): imported when named

        if spec in AGENT_TASKS:
            return AGENT_TASKS[spec]
        raise TaskError(f"unknown task {spec!r}: use one of {sorted([*BUILTIN_TASKS, *AGENT_TASKS])} or "
                        f"'module:object' (e.g. 'my_tasks:MyTask' or 'path/to/tasks.py:make_task')")
    obj = import_object(spec, "task spec")
    if isinstance(obj, Task):
        return obj
    if isinstance(obj, type) and not issubclass(obj, Task):
        raise TaskError(f"task spec {spec!r} names class {obj.__name__}, which is not a monorl.tasks.Task subclass")
    if not callable(obj):
        raise TaskError(f"task spec {spec!r} names a {type(obj).__name__}: expected a Task, a Task subclass or a "
                        "factory")
    return obj


