"""Tools from specs (``"FILE.py:fn1,fn2"``, ``"module:fn"``, the built-in ``"python"``): the functions a task's
`tools=` names, each checked to become a schema. Above `tools.py` and the sandbox, which it offers as a built-in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from monorl.agent.schema import SchemaError, function_schema
from monorl.tasks.spec import TaskError, import_object


def builtin_tools() -> dict[str, Callable[[], Callable[..., Any]]]:
    """Built-in tools by name -> a factory of the tool with default settings."""
    from monorl.agent.sandbox import make_python_tool  # here: the sandbox is only imported when asked for

    return {"python": make_python_tool}


def load_tools(spec: str | Sequence[Any]) -> list[Callable[..., Any]]:
    """Tool functions from a spec: ``"FILE.py:fn1,fn2"``, ``"module:fn"``, a built-in name (``"python"``), several
    of those separated by spaces or ``;``, or a list of such strings and callables."""
    items: list[Any] = spec.replace(";", " ").split() if isinstance(spec, str) else list(spec)
    out: list[Callable[..., Any]] = []
    for item in items:
        if callable(item):
            out.append(item)
            continue
        if not isinstance(item, str):
            raise TaskError(f"tool spec {item!r}: expected a string or a function")
        if ":" not in item:
            builtins = builtin_tools()
            if item not in builtins:
                raise TaskError(f"unknown tool {item!r}: use a built-in ({', '.join(builtins)}) or "
                                "'FILE.py:fn1,fn2' / 'module:fn'")
            out.append(builtins[item]())
            continue
        module_name, _, names = item.rpartition(":")
        if not module_name or not names:
            raise TaskError(f"tool spec {item!r} must look like 'FILE.py:fn1,fn2' or 'module:fn'")
        for name in (n.strip() for n in names.split(",") if n.strip()):
            obj = import_object(item, "tool spec", attr=name)
            if isinstance(obj, type):
                raise TaskError(f"tool spec {item!r}: {name!r} is a class; tools are functions (a class whose "
                                "methods are tools is an environment_factory)")
            if not callable(obj):
                raise TaskError(f"tool spec {item!r}: {name!r} is a {type(obj).__name__}, not a function")
            out.append(obj)
    for fn in out:  # a function that cannot become a schema fails here, with its name, not at the first call
        try:
            function_schema(fn)
        except SchemaError as e:
            raise TaskError(str(e)) from None
    return out
