"""What a task spec names and how it is called: `import_object` for `module:object` specs (a module name or a
.py file), the keyword arguments a task takes (`task_parameters`), calling a task factory with arguments checked
(`construct_task`), and the one-line errors they raise. The registry of built-in names is `monorl.task_registry`
(above the agent package, which adds the agent tasks)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from monorl.tasks.base import TaskDataNotFound


class TaskError(ValueError):
    """A task spec or task arguments that cannot be used (a user error: reported as one line)."""


class DatasetNotFound(TaskError, TaskDataNotFound):
    """A dataset task's file is missing."""


def task_parameters(factory: Any) -> list[tuple[inspect.Parameter, Any]] | None:
    """The keyword arguments a task class or factory takes, each with the callable that declares it (whose
    docstring describes it): its signature's, then, when its ``**kwargs`` go on to another task (its `kwargs_to`
    attribute: that object, or a 'module:object' spec), that one's, followed on. None when it has no signature
    or takes ``**kwargs`` without saying where they go (any keyword is then accepted)."""
    out: list[tuple[inspect.Parameter, Any]] = []
    while factory is not None:
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            return None
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        seen = {p.name for p, _ in out}
        out += [(p, factory) for p in params.values() if p.kind in kinds and p.name not in seen]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return out
        target = getattr(factory, "kwargs_to", None)
        if target is None:
            return None
        factory = import_object(target, "kwargs_to") if isinstance(target, str) else target
    return out


def construct_task(factory: Any, kwargs: dict[str, Any], spec: str) -> Any:
    """`factory(**kwargs)`, with arguments it does not take named (a typo'd --task.args.x) before the call,
    and its own ValueError/TypeError (a bad argument value) reported as one TaskError line."""
    params = task_parameters(factory)
    if params:
        accepted = [p.name for p, _ in params]
        if unknown := sorted(set(kwargs) - set(accepted)):
            raise TaskError(f"task {spec!r} has no argument {', '.join(map(repr, unknown))} (--task.args.*); "
                            f"its arguments: {', '.join(accepted) or 'none'}")
    try:
        return factory(**kwargs)
    except TaskDataNotFound:
        raise  # as it is: `monorl plan` plans without the data
    except (TypeError, ValueError) as e:
        raise TaskError(f"task {spec!r}: {e}") from e


def import_object(spec: str, what: str, attr: str | None = None) -> Any:
    """What a `module:object` spec names (module: an importable name or a path to a .py file; object: a dotted
    attribute path), every failure one TaskError naming `what` and the spec. `attr`: the object to look up in the
    spec's module instead of the spec's own (a spec naming several: 'FILE.py:fn1,fn2')."""
    module_name, _, attr_path = spec.rpartition(":")
    if not module_name or not attr_path:
        raise TaskError(f"{what} {spec!r} must look like 'module:object' (or 'path/to/file.py:object')")
    attr_path = attr if attr is not None else attr_path
    obj: Any = _import(module_name, spec, what)
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"{what} {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    return obj


def _import(module_name: str, spec: str, what: str = "task spec") -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise TaskError(f"{what} {spec!r}: no such file {path}")
        name = f"_monorl_user_task_{path.stem}"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise TaskError(f"{what} {spec!r}: cannot load {path}")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise TaskError(f"{what} {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        raise TaskError(f"{what} {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
