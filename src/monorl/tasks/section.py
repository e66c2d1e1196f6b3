"""The run config's `task` section: which task, with which arguments (`monorl.task_registry.load_task`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TaskSection:
    name: str = "sum_digits"  # built-in name or "module:object"
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the task: --task.args.NAME value
