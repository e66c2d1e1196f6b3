"""Tool calls in a model's text, Hermes style (Qwen2.5 / Qwen3 / Hermes templates):
``<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>``, any number in one turn; and checking a call's
arguments against the function's signature before it runs.

A block that is not a call (bad JSON, no name, arguments that are not an object) is still returned, with its
`error` set, so the runner answers it with an error message and counts a failure instead of ignoring it. A last
block left open (the turn stopped at ``</tool_call>`` as a stop string, which the engine cuts from the text) is
read as a call when its JSON parses."""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

from monorl.tasks.harmony import is_harmony, parse_harmony

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    """One ``<tool_call>`` block: a name and arguments, or an `error` saying why it is not a usable call."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of `text`, in order; in a Harmony completion (GPT-OSS), its messages to
    ``functions.NAME`` (`harmony_tool_calls`)."""
    if is_harmony(text):

        return harmony_tool_calls(text)
    calls = []
    for m in _BLOCK.finditer(text):
        raw, closed = m.group(1), m.group(0).endswith(CALL_CLOSE)
        calls.append(_parse_block(raw.strip(), closed))
    return calls


def _parse_block(raw: str, closed: bool) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        where = "" if closed else " (and the block was not closed with </tool_call>)"
        return ToolCall(None, error=f"the tool call is not valid JSON: {e.msg} at position {e.pos}{where}", raw=raw)
    if not isinstance(obj, dict):
        return ToolCall(None, error=f"a tool call must be a JSON object, got {type(obj).__name__}", raw=raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, error='the tool call has no "name" (expected {"name": ..., "arguments": {...}})',
                        raw=raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments object as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name, error=f'the "arguments" of {name!r} are a string that is not a JSON object', raw=raw)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name, error=f'the "arguments" of {name!r} must be a JSON object, got {type(args).__name__}',
                        raw=raw)
    return ToolCall(name, args, raw=raw)


def format_tool_call(name: str, arguments: dict[str, Any], compact: bool = False) -> str:
    """The text of one call, as a model writes it (for reference solutions and tests)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False,
                      separators=(",", ":") if compact else None)
    return f"{CALL_OPEN}{body}{CALL_CLOSE}" if compact else f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


# ---- arguments against a signature ------------------------------------------------------------------

class ArgumentError(TypeError):
    """Arguments a model wrote that the function cannot take; the message goes back to the model."""


def bind_arguments(params: list[inspect.Parameter], hints: dict[str, Any], args: dict[str, Any],
                   tool: str) -> dict[str, Any]:
    """`args` checked against the tool's parameters and type hints (unknown or missing names, JSON values of the
    wrong type), converted where JSON has no such type (a tuple from an array, an Enum member from its value)."""
    names = {p.name for p in params}
    if unknown := sorted(set(args) - names):
        raise ArgumentError(f"{tool} has no argument {', '.join(map(repr, unknown))}; its arguments: "
                            f"{', '.join(sorted(names)) or 'none'}")
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in args]
    if missing:
        raise ArgumentError(f"{tool} is missing required argument {', '.join(map(repr, missing))}")
    out = {}
    for name, value in args.items():
        hint = hints.get(name, Any)
        try:
            out[name] = coerce(value, hint)
        except ArgumentError as e:
            raise ArgumentError(f"{tool} argument {name!r}: {e}") from None
    return out


def _describe(hint: Any) -> str:
    return getattr(hint, "__name__", None) if get_origin(hint) is None else str(hint).replace("typing.", "")


def coerce(value: Any, hint: Any) -> Any:
    """`value` (decoded JSON) as `hint` wants it, or ArgumentError. bool is not an int; an int is a float."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any or hint is inspect.Parameter.empty:
        return value
    if origin is Union or origin is types.UnionType:
        for sub in args:
            try:
                return coerce(value, sub)
            except ArgumentError:
                continue
        raise ArgumentError(f"expected {_describe(hint)}, got {json.dumps(value)[:60]}")
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ArgumentError(f"expected one of {list(args)}, got {json.dumps(value)[:60]}")
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        for member in hint:
            if member.value == value and type(member.value) is type(value):
                return member
        raise ArgumentError(f"expected one of {[m.value for m in hint]}, got {json.dumps(value)[:60]}")
    if hint is type(None) or hint is None:
        if value is None:
            return None
        raise ArgumentError(f"expected null, got {json.dumps(value)[:60]}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 3.0 is 3 (JSON writers differ); 3.5 is not an int
    base = origin or hint
    checks = {bool: lambda v: isinstance(v, bool), int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, float), str: lambda v: isinstance(v, str),
              list: lambda v: isinstance(v, list), tuple: lambda v: isinstance(v, list | tuple),
              dict: lambda v: isinstance(v, dict)}
    if base not in checks:
        return value  # a hint JSON cannot express (the schema step already refused most): pass through
    if not checks[base](value):
        raise ArgumentError(f"expected {_describe(hint)}, got {json.dumps(value)[:60]}")
    if base is list and args:
        return [coerce(v, args[0]) for v in value]
    if base is tuple:
        if args and ... not in args:
            if len(args) != len(value):
                raise ArgumentError(f"expected {len(args)} items, got {len(value)}")
            return tuple(coerce(v, a) for v, a in zip(value, args, strict=True))
        return tuple(value)
    if base is dict and len(args) == 2:
        return {k: coerce(v, args[1]) for k, v in value.items()}
    return value


def harmony_tool_calls(text: str) -> list[ToolCall]:
    """The calls of a Harmony completion: its messages to ``functions.NAME``, their JSON arguments."""
    calls = []
    for m in parse_harmony(text):
        if not (m.recipient or "").startswith("functions."):
            continue
        name, raw = m.recipient[len("functions."):], m.content.strip()
        try:
            args = json.loads(raw) if raw else {}
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=f"the arguments of {name!r} are not valid JSON: {e.msg}", raw=raw))
            continue
        if not isinstance(args, dict):
            calls.append(ToolCall(name, error=f"the arguments of {name!r} must be a JSON object", raw=raw))
            continue
        calls.append(ToolCall(name, args, raw=raw))
    return calls
