"""Paths in a run config, made absolute before the run stores its config: `--task.args.path d.jsonl` or
`--task.args.reward rw.py:fn` given relative to where `monorl train` started must still name the same files when
`--resume` or `monorl eval` runs from another directory.

A value is taken for a path when it names something that exists relative to the current directory (a file, a
directory, or the file of a `FILE:object` spec; comma-separated lists part by part); anything else (a Hub name,
`module:object`, a number) is left as given.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any


def _absolute(value: str) -> str:
    if not value or "\n" in value:
        return value
    if Path(value).exists():
        return str(Path(value).resolve())
    file, colon, obj = value.partition(":")
    if colon and file and Path(file).is_file():  # FILE.py:fn (tools: FILE.py:fn1,fn2 -- the file is the first part)
        return f"{Path(file).resolve()}:{obj}"
    parts = re.split(r"(\s+|,)", value)  # lists: "a.py:f,b.py:g", "python my_tools.py:lookup"
    if len(parts) > 1:
        return "".join(p if i % 2 else _absolute(p) for i, p in enumerate(parts))
    return value


def absolute_value(value: Any) -> Any:
    """`value` with every string that names an existing path made absolute (lists and dicts element-wise)."""
    if isinstance(value, str):
        return _absolute(value)
    if isinstance(value, list | tuple):
        return type(value)(absolute_value(v) for v in value)
    if isinstance(value, dict):
        return {k: absolute_value(v) for k, v in value.items()}
    return value


def with_absolute_paths(cfg: Any) -> Any:
    """A copy of the run config with the model and teacher paths, the task's name (a `FILE.py:Class` spec) and the
    task's arguments absolute where they name existing paths."""
    model = dataclasses.replace(cfg.model, path=absolute_value(cfg.model.path))
    name = cfg.task.name
    if ":" in name:  # FILE.py:Class (a bare name is a built-in task, whatever the directory holds)
        name = absolute_value(name)
    task = dataclasses.replace(cfg.task, name=name, args=absolute_value(cfg.task.args))
    teacher = dataclasses.replace(cfg.teacher, path=absolute_value(cfg.teacher.path))
    return dataclasses.replace(cfg, model=model, task=task, teacher=teacher)
