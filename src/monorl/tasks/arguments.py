"""A task's arguments (`--task.args.NAME`) as `monorl train --help` lists them: read from the task's signature
(name, default) and its docstring's ``Args:`` section (Google style: ``name: what it is``), without constructing
the task."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from monorl.tasks.base import Task
from monorl.tasks.spec import TaskError, task_parameters

_ARG_LINE = re.compile(r"^\s{2,}(\w+)(?:\s*\([^)]*\))?:\s*(.*)$")


def _arg_docs(doc: str | None) -> dict[str, str]:
    """{name: description} from a docstring's ``Args:`` section (continuation lines joined)."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:"))
    except StopIteration:
        return out
    body = lines[start + 1:]
    if start == 0:  # a docstring opening with "Args:": cleandoc dedented its entries with the rest; indent them back
        body = [f"    {line}" if line else line for line in body]
    name, indent = None, None
    for line in body:
        if line and not line.startswith(" "):  # the next section
            break
        depth = len(line) - len(line.lstrip())
        if (m := _ARG_LINE.match(line)) and (indent is None or depth <= indent):
            name, indent = m.group(1), depth
            out[name] = m.group(2).strip()
        elif name and line.strip():  # deeper: the description goes on
            out[name] += " " + line.strip()
    return out


def task_arguments(obj: Any) -> list[tuple[str, Any, str]]:
    """(name, default or inspect.Parameter.empty, description) of each keyword argument the task takes, those its
    ``**kwargs`` pass on included (`task_parameters`); a description is the first found in the docstrings (class,
    then ``__init__``) of the callable declaring the argument, then of the others it passes through. `obj`: what
    the task spec names (`monorl.task_registry.task_object`)."""
    if isinstance(obj, Task):
        return []
    params = task_parameters(obj)
    if not params:
        return []
    declared = {src: _docs_of(src) for _, src in params}  # every declarer, outermost first
    return [(p.name, p.default, declared[src].get(p.name) or next(
        (d[p.name] for d in declared.values() if d.get(p.name)), "")) for p, src in params]


def _docs_of(source: Any) -> dict[str, str]:
    """{argument: description} from a task class's docstring and its ``__init__``'s (or a factory's)."""
    fn = source.__init__ if isinstance(source, type) else source
    return {**_arg_docs(source.__doc__), **_arg_docs(fn.__doc__)}


def task_args_help(spec: str, task_object: Callable[[str], Any], given: dict[str, Any] | None = None) -> str:
    """The help section listing task `spec`'s arguments (one line each: flag, description, default; `given`: the
    values the config sets, shown instead of the signature's defaults). `task_object`: the registry's lookup of a
    spec (`monorl.task_registry.task_object`)."""
    try:
        args = task_arguments(task_object(spec))
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
