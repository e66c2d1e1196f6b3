"""Tools the TRL way: plain Python functions (sync or ``async def``) with type hints and a Google-style
docstring; their JSON schemas go into the prompt, the model calls them with ``<tool_call>`` blocks, and each call's
result (or an error) goes back as a ``tool`` message.

`ToolSet.run(text)` never raises: a malformed call, an unknown tool, arguments that do not fit the signature, an
exception, a timeout, or a result that is neither text nor JSON-serialisable each become an error string for the
model and a counted failure of that tool (`ToolResult.ok` False); a tool that raises `ToolFailed(text)` fails
with `text` as the model's result, as is (the `python` tool does, for a program that crashed or was killed).
A result may hold images: a list of content parts, TRL's convention (`agent.content`:
``[{"type": "image", "image": ...}, {"type": "text", "text": ...}]``). Results longer than `max_result_chars` are
cut (with the images whose placeholders were cut). Plain functions time out through a thread with a deadline
(`executor.call_with_timeout`: fine for trusted functions, a hung one keeps its thread); code the model writes
runs in the `python` tool's sandboxed process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from monorl.agent.calls import ArgumentError, ToolCall, bind_arguments, parse_tool_calls
from monorl.agent.content import cut_images, is_content_parts, parts_text
from monorl.agent.executor import call_with_timeout
from monorl.agent.schema import SchemaError, function_schema, tool_parameters

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_RESULT_CHARS = 4096
# what failures are counted under when the call names no tool it could run (one key, however many names a model
# invents, so the metrics keep a fixed set of keys)
MALFORMED_CALL, UNKNOWN_TOOL = "malformed_call", "unknown_tool"


class ToolFailed(Exception):
    """Raised by a tool whose call failed, with the text the model reads as the result (the call counts as failed:
    `ToolResult.ok` False)."""


@dataclass
class Tool:
    """One callable tool: the function, its schema and what binding its arguments needs. `timeout` overrides
    the tool set's (the sandboxed `python` tool sets its own, longer than its child's wall-clock limit)."""

    fn: Callable[..., Any]
    name: str
    schema: dict[str, Any]
    timeout: float | None = None

    @classmethod
    def of(cls, fn: Callable[..., Any] | Tool, timeout: float | None = None) -> Tool:
        if isinstance(fn, Tool):
            return fn
        if not callable(fn):
            raise SchemaError(f"a tool must be a function, got {type(fn).__name__}")
        schema = function_schema(fn)
        return cls(fn=fn, name=schema["function"]["name"], schema=schema,
                   timeout=timeout if timeout is not None else getattr(fn, "tool_timeout", None))

    def bind(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """`arguments` checked against the signature (`calls.bind_arguments`); ArgumentError says what is wrong."""
        return bind_arguments(tool_parameters(self.fn), get_type_hints(self.fn), arguments, self.name)


@dataclass
class ToolResult:
    """One call's outcome: `content` is what the model reads (the result, or the error text; an image's place a
    vision placeholder), `images` the images it returned, in order; `counted_as` the tool it counts for in the
    metrics (`name`, or MALFORMED_CALL / UNKNOWN_TOOL)."""

    name: str
    content: str
    ok: bool
    seconds: float = 0.0
    truncated: bool = False
    counted_as: str = ""
    images: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counted_as = self.counted_as or self.name

    def message(self) -> dict[str, Any]:
        """The ``tool`` message for the conversation (the role chat templates render as a tool response), its
        images under "images" (`agent.content`)."""
        images = {"images": self.images} if self.images else {}
        return {"role": "tool", "name": self.name, "content": self.content, **images}


def result_text(value: Any) -> str:
    """A tool's return value as the text the model reads: a string as is, else its JSON. Raises TypeError for a
    value JSON cannot hold (bytes, an object, NaN)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"returned a {type(value).__name__}, which is neither text nor JSON-serialisable ({e})") \
            from None


class ToolSet:
    """The tools of an episode, by name. `schemas` go to the chat template (``tools=``); `run(text)` executes
    every call in an assistant turn, in order."""

    def __init__(self, tools: Iterable[Callable[..., Any] | Tool] = (), timeout: float = DEFAULT_TIMEOUT_S,
                 max_result_chars: int = DEFAULT_MAX_RESULT_CHARS) -> None:
        if timeout <= 0 or max_result_chars < 1:
            raise ValueError(f"need timeout > 0 and max_result_chars >= 1, got {timeout}, {max_result_chars}")
        self.timeout, self.max_result_chars = float(timeout), int(max_result_chars)
        self.tools: dict[str, Tool] = {}
        for fn in tools:
            tool = Tool.of(fn)
            if tool.name in self.tools:
                raise SchemaError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def __len__(self) -> int:
        return len(self.tools)

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def run(self, text: str) -> list[ToolResult]:
        """Run every ``<tool_call>`` of an assistant turn's text; one result per block (none: no calls)."""
        return [self.call(c) for c in parse_tool_calls(text)]

    def call(self, call: ToolCall) -> ToolResult:
        start = time.perf_counter()
        name = call.name or MALFORMED_CALL
        if call.error is not None:
            return ToolResult(name, f"Error: {call.error}", ok=False, counted_as=MALFORMED_CALL)
        tool = self.tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(name, f"Error: unknown tool {name!r}; available tools: {known}", ok=False,
                              counted_as=UNKNOWN_TOOL)
        timeout = tool.timeout if tool.timeout is not None else self.timeout
        try:
            kwargs = tool.bind(call.arguments)
        except ArgumentError as e:
            return self._fail(name, f"Error: bad arguments: {e}", start)
        try:
            value = call_with_timeout(tool.fn, timeout=timeout, **kwargs)
        except ToolFailed as e:
            return self._fail(name, str(e), start)
        except TimeoutError:
            return self._fail(name, f"Error: tool {name!r} timed out after {timeout:g} s", start)
        except Exception as e:  # noqa: BLE001 -- any failure of a tool is a message for the model
            return self._fail(name, f"Error: tool {name!r} raised {type(e).__name__}: {e}", start)
        try:
            content, images = parts_text(value) if is_content_parts(value) else (result_text(value), [])
        except (TypeError, ValueError) as e:
            return self._fail(name, f"Error: tool {name!r} {e}", start)
        content, truncated = self._cut(content)
        return ToolResult(name, content, ok=True, seconds=time.perf_counter() - start, truncated=truncated,
                          images=cut_images(content, images))

    def _fail(self, name: str, content: str, start: float) -> ToolResult:
        content, truncated = self._cut(content)
        return ToolResult(name, content, ok=False, seconds=time.perf_counter() - start, truncated=truncated)

    def _cut(self, content: str) -> tuple[str, bool]:
        if len(content) <= self.max_result_chars:
            return content, False
        return content[: self.max_result_chars] + f"\n[truncated: {len(content)} characters]", True
