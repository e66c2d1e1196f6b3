"""A task's arguments (`--task.args.NAME`) as `monorl train --help` lists them: read from the task's signature
(name, default) and its docstring's ``Args:`` section (Google style: ``name: what it is``), without constructing
the task."""

from __future__ import annotations

import inspect
import re
from typing import Any

from monorl.tasks import TaskError, task_object
from monorl.tasks.base import Task

_ARG_LINE = re.compile(r"^\s{2,}(\w+)(?:\s*\([^)]*\))?:\s*(.*)$")


def _arg_docs(doc: str | None) -> dict[str, str]:
    """{name: description} from a docstring's ``Args:`` section (continuation lines joined)."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:"))
    except StopIteration:
        return out
    name, indent = None, None
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):  # the next section
            break
        depth = len(line) - len(line.lstrip())
        if (m := _ARG_LINE.match(line)) and (indent is None or depth <= indent):
            name, indent = m.group(1), depth
            out[name] = m.group(2).strip()
        elif name and line.strip():  # deeper: the description goes on
            out[name] += " " + line.strip()
    return out


def task_arguments(spec: str) -> list[tuple[str, Any, str]]:
    """(name, default or inspect.Parameter.empty, description) of each keyword argument the task takes."""
    obj = task_object(spec)
    if isinstance(obj, Task):
        return []
    fn = obj.__init__ if isinstance(obj, type) else obj
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return []
    docs = {**_arg_docs(obj.__doc__), **_arg_docs(fn.__doc__)}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [(n, p.default, docs.get(n, "")) for n, p in params.items() if p.kind in kinds]


def task_args_help(spec: str, given: dict[str, Any] | None = None) -> str:
    """The help section listing task `spec`'s arguments (one line each: flag, description, default; `given`: the
    values the config sets, shown instead of the signature's defaults)."""
    try:
        args = task_arguments(spec)
    except TaskError as e:
        return f"task.args: (cannot list the arguments of task {spec!r}: {e})\n"
    if not args:
        return f"task.args of task {spec!r}: none\n"
    lines = [f"task.args of task {spec!r} (--task.args.NAME value; --task.name picks the task):"]
    for name, default, doc in args:
        if given and name in given:
            shown = f"this config: {given[name]!r}"
        else:
            shown = "required" if default is inspect.Parameter.empty else f"default: {default!r}"
        lines.append(f"  --task.args.{name:<20} {doc}{' ' if doc else ''}({shown})")
    return "\n".join(lines) + "\n"
