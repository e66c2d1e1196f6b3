"""A Python function -> the JSON schema that chat templates' ``tools=`` take (OpenAI / HF function-calling
shape), from its type hints and Google-style docstring; the same output as
``transformers.utils.get_json_schema`` (the tests hold them equal), without depending on transformers.

    def multiply(x: float, y: float) -> float:
        '''Multiply two numbers.

        Args:
            x: The first number.
            y: The second number.
        '''

    function_schema(multiply) == {"type": "function", "function": {"name": "multiply", "description":
        "Multiply two numbers.", "parameters": {"type": "object", "properties": {"x": {"type": "number",
        "description": "The first number."}, ...}, "required": ["x", "y"]}, "return": {"type": "number"}}}
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


class SchemaError(ValueError):
    """A function that cannot become a tool schema (a missing hint or docstring entry): one line naming it."""


_JSON_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BASIC = {**{t: {"type": n} for t, n in _JSON_SCALARS.items()}, list: {"type": "array"}, tuple: {"type": "array"},
          dict: {"type": "object"}, Any: {}}

# The Google docstring sections, as transformers splits them (same regexes' meaning, so the same text comes out).
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG = re.compile(r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*"
                  r"(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def _enum_schema(values: list[Any], what: str) -> dict[str, Any]:
    if not values or any(type(v) not in _JSON_SCALARS for v in values):
        raise SchemaError(f"{what}: enum values must be JSON scalars (int, float, str, bool, None), got {values!r}")
    kinds = list(dict.fromkeys(_JSON_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def type_schema(hint: Any, what: str = "type hint") -> dict[str, Any]:
    """The JSON schema of one type hint: scalars, list / tuple / dict (with their arguments), Union / Optional,
    Literal and Enum classes."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_schema([m.value for m in hint], what)
        if hint in _BASIC:
            return dict(_BASIC[hint])
        raise SchemaError(f"{what}: cannot describe {hint!r} in JSON schema; use int, float, str, bool, list, "
                          "tuple, dict, Literal, an Enum or a Union of those")
    if origin is Union or origin is types.UnionType:
        subs = [type_schema(t, what) for t in args if t is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subs):
            names = sorted({s["type"] for s in subs})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subs}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal:
        return _enum_schema(list(args), what)
    if origin is list:
        return {"type": "array", "items": type_schema(args[0], what)} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise SchemaError(f"{what}: {hint} is not supported; use list[...] for variable-length arrays")
        return {"type": "array", "prefixItems": [type_schema(t, what) for t in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = type_schema(args[1], what)
        return out
    raise SchemaError(f"{what}: cannot describe {hint!r} in JSON schema")


def parse_docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    """(description, {argument: description}, returns description) of a Google-style docstring."""
    description = m.group(1).strip() if (m := _DESCRIPTION.search(doc)) else None
    returns = m.group(1).strip() if (m := _RETURNS.search(doc)) else None
    args: dict[str, str] = {}
    if m := _ARGS.search(doc):
        block = "\n".join(line for line in m.group(1).split("\n") if line.strip())
        args = {name: re.sub(r"\s*\n+\s*", " ", text.strip()) for _, name, text in _ARG.findall(block)}
    return description, args, returns


def tool_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The parameters a model fills in: the signature without an unannotated ``self`` / ``cls``."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        params = params[1:]
    return params


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``{"type": "function", "function": {"name", "description", "parameters"[, "return"]}}`` for `fn`."""
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise SchemaError(f"tool {name!r} has no docstring: describe it and each argument (Google style, 'Args:')")
    description, arg_docs, returns_doc = parse_docstring(doc.strip())
    try:
        hints = get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 -- a forward reference that does not resolve, in user code
        raise SchemaError(f"tool {name!r}: cannot resolve its type hints: {e}") from None
    params = tool_parameters(fn)
    properties: dict[str, Any] = {}
    required = []
    for p in params:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise SchemaError(f"tool {name!r}: *{p.name} / **{p.name} cannot be described; name each argument")
        if p.name not in hints:
            raise SchemaError(f"tool {name!r}: argument {p.name!r} has no type hint")
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
        properties[p.name] = type_schema(hints[p.name], f"tool {name!r} argument {p.name!r}")
    for arg, schema in properties.items():
        if arg not in arg_docs:
            raise SchemaError(f"tool {name!r}: the docstring's Args: section does not describe {arg!r}")
        desc = arg_docs[arg]
        if choices := _CHOICES.search(desc):
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            desc = desc[: choices.start()].strip()
        schema["description"] = desc
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        try:
            out["return"] = type_schema(hints["return"])
        except SchemaError:  # the model never writes the return value: leave an odd one out, as transformers does
            pass
        else:
            if returns_doc is not None:
                out["return"]["description"] = returns_doc
    return {"type": "function", "function": out}
