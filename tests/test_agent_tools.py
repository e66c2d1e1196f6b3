"""Tools: schemas (equal to transformers' get_json_schema), Hermes call parsing, and calls that fail in every way
becoming error strings and counted failures, never exceptions."""

from __future__ import annotations

import asyncio
import enum
import time
from typing import Any, Literal

import pytest

from monorl.agent.calls import coerce, format_tool_call, parse_tool_calls
from monorl.agent.metrics import EpisodeRecord, episode_metrics
from monorl.agent.schema import SchemaError, function_schema
from monorl.agent.tool_specs import load_tools
from monorl.agent.tools import ToolSet
from monorl.tasks import TaskError


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number,
            described on two lines.

    Returns:
        Their sum.
    """
    return a + b


def search(query: str, limit: int | None = None, tags: list[str] | None = None, mode: Literal["fast", "exact"] = "fast",
           weights: dict[str, float] | None = None, color: Color = Color.RED, pair: tuple[int, str] = (1, "a"),
           extra: Any = None, ratio: float | int = 1.0) -> dict[str, Any]:
    """Search the index.

    Args:
        query: What to look for.
        limit: At most this many results.
        tags: Tags to filter on.
        mode: How to match (choices: ["fast", "exact"])
        weights: Field weights.
        color: A color.
        pair: A pair.
        extra: Anything.
        ratio: A ratio.
    """
    return {"query": query}


class Calculator:
    def multiply(self, x: float, y: float) -> float:
        """Multiply two numbers.

        Args:
            x: The first factor.
            y: The second factor.
        """
        return x * y


@pytest.mark.parametrize("fn", [add, search, Calculator().multiply], ids=["add", "search", "method"])
def test_schema_equals_transformers(fn):
    get_json_schema = pytest.importorskip("transformers.utils").get_json_schema
    assert function_schema(fn) == get_json_schema(fn)


def test_schema_errors_name_the_problem():
    def no_doc(x: int) -> int:
        return x

    def no_hint(x):
        """Doc.

        Args:
            x: The input.
        """

    def undocumented(x: int) -> int:
        """Doc without args."""
        return x

    with pytest.raises(SchemaError, match="no docstring"):
        function_schema(no_doc)
    with pytest.raises(SchemaError, match="'x' has no type hint"):
        function_schema(no_hint)
    with pytest.raises(SchemaError, match="does not describe 'x'"):
        function_schema(undocumented)


def test_parse_several_calls_and_malformed_ones():
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> and '
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>[1, 2]</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 7}}')  # left open: the stop string was cut
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("add", {"a": 1, "b": 2}, True), ("add", {"a": 5}, True), (None, {}, False), (None, {}, False),
        (None, {}, False), ("add", {"a": 7}, True)]
    assert "not valid JSON" in calls[2].error and 'no "name"' in calls[3].error and "JSON object" in calls[4].error
    assert parse_tool_calls("no calls here") == []
    assert parse_tool_calls(format_tool_call("f", {"x": 3}, compact=True))[0].arguments == {"x": 3}


def test_coerce_checks_types():
    assert coerce(3, float) == 3.0 and coerce(3.0, int) == 3 and coerce("red", Color) is Color.RED
    assert coerce([1, "a"], tuple[int, str]) == (1, "a") and coerce(None, int | None) is None
    for value, hint in [(True, int), (3.5, int), ("3", int), ([1, "x"], list[int]), ("green", Color),
                        ("slow", Literal["fast", "exact"]), ({"a": "b"}, dict[str, float])]:
        with pytest.raises(TypeError):
            coerce(value, hint)


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError("disk on fire")


def huge(n: int) -> str:
    """A long result.

    Args:
        n: Characters.
    """
    return "y" * n


def opaque(x: int) -> Any:
    """Returns an object JSON cannot hold.

    Args:
        x: Ignored.
    """
    return object()


def raw_bytes(x: int) -> Any:
    """Returns bytes.

    Args:
        x: Ignored.
    """
    return b"\x00\x01"


def structured(x: int) -> dict[str, Any]:
    """Returns JSON.

    Args:
        x: A number.
    """
    return {"x": x, "list": [1, 2]}


async def async_double(x: int) -> int:
    """Double asynchronously.

    Args:
        x: A number.
    """
    await asyncio.sleep(0.01)
    return 2 * x


async def async_hang(x: int) -> int:
    """Never returns.

    Args:
        x: Ignored.
    """
    await asyncio.sleep(3600)
    return x


def call(name: str, **arguments: Any) -> str:
    return format_tool_call(name, arguments)


def test_every_failure_is_a_message_and_a_counted_failure():
    tools = ToolSet([add, slow, broken, huge, opaque, raw_bytes, structured, async_double, async_hang], timeout=5.0,
                    max_result_chars=1000)
    text = "".join([call("add", a=1), call("add", a=1, b=5), call("nope", a=1), call("add", a="one"),
                    call("add", b=1), call("add", a=1, c=2), call("broken", x=1), call("slow", seconds=30),
                    call("huge", n=3_000_000), call("opaque", x=1), call("raw_bytes", x=1), call("structured", x=4),
                    call("async_double", x=21), call("async_hang", x=1), "<tool_call>{oops}</tool_call>"])
    results = tools.run(text)  # the hung calls are cut at their deadline (the test would hang otherwise)
    got = [(r.name, r.ok) for r in results]
    assert got == [("add", True), ("add", True), ("nope", False), ("add", False), ("add", False), ("add", False),
                   ("broken", False), ("slow", False), ("huge", True), ("opaque", False), ("raw_bytes", False),
                   ("structured", True), ("async_double", True), ("async_hang", False), ("malformed_call", False)]
    text_of = [r.content for r in results]
    assert text_of[0] == "3" and text_of[1] == "6"
    assert "unknown tool 'nope'" in text_of[2] and "available tools: add" in text_of[2]
    assert "bad arguments" in text_of[3] and "expected int" in text_of[3]
    assert "missing required argument 'a'" in text_of[4] and "no argument 'c'" in text_of[5]
    assert "RuntimeError: disk on fire" in text_of[6]
    assert "timed out after 5 s" in text_of[7] and "timed out" in text_of[13]
    assert results[8].truncated and len(text_of[8]) < 1100 and "[truncated: 3000000 characters]" in text_of[8]
    assert "neither text nor JSON-serialisable" in text_of[9] and "bytes" in text_of[10]
    assert text_of[11] == '{"x": 4, "list": [1, 2]}' and text_of[12] == "42"
    assert "not valid JSON" in text_of[14]
    assert results[0].message() == {"role": "tool", "name": "add", "content": "3"}

    record = EpisodeRecord()
    record.add_tool_results(results)
    assert record.tool_calls["add"] == 5 and record.tool_failures["add"] == 3
    metrics = episode_metrics([record, EpisodeRecord()])
    assert metrics["tools/call_frequency"] == len(results) / 2
    assert metrics["tools/failure_frequency"] == pytest.approx(10 / 15)
    assert metrics["tools/add/failure_frequency"] == 0.6 and metrics["tools/add/calls"] == 2.5
    assert metrics["tools/unknown_tool/failure_frequency"] == 1.0 and "tools/nope/calls" not in metrics


def test_load_tools_from_specs(tmp_path, monkeypatch):
    f = tmp_path / "my_tools.py"
    f.write_text('def inc(x: int) -> int:\n    """Increment.\n\n    Args:\n        x: A number.\n    """\n'
                 '    return x + 1\n\n'
                 'def dec(x: int) -> int:\n    """Decrement.\n\n    Args:\n        x: A number.\n    """\n'
                 '    return x - 1\n\nVALUE = 3\n\ndef bad(x):\n    return x\n')
    inc, dec = load_tools(f"{f}:inc,dec")
    assert inc(1) == 2 and dec(1) == 0
    names = [t.__name__ for t in load_tools(f"python {f}:inc")]
    assert names == ["python", "inc"]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [t(5) for t in load_tools(["my_tools:dec", inc])] == [4, 6]  # a module name, and a function as is
    with pytest.raises(TaskError, match="no attribute 'nope'"):
        load_tools(f"{f}:nope")
    with pytest.raises(TaskError, match="not a function"):
        load_tools(f"{f}:VALUE")
    with pytest.raises(TaskError, match="no docstring"):
        load_tools(f"{f}:bad")
    with pytest.raises(TaskError, match="unknown tool 'calc'"):
        load_tools("calc")
    with pytest.raises(TaskError, match="no such file"):
        load_tools("missing.py:f")



def test_a_tool_result_with_images_is_text_with_placeholders(tmp_path):
    """TRL's multimodal tool result (a list of content parts): the text the model reads has Qwen-VL's placeholder at
    each image's place, the images go with the message; a cut result keeps only the images it still shows."""
    from monorl.agent.environments import _check_messages
    from monorl.tasks.images import PLACEHOLDER

    def look(n: int) -> list:
        """Look.

        Args:
            n: How many pictures.
        """
        return [{"type": "text", "text": "x" * 10}, *[{"type": "image", "image": f"{i}.png"} for i in range(n)]]

    def bad() -> list:
        """Bad."""
        return [{"type": "image"}]

    [r] = ToolSet([look]).run(call("look", n=2))
    assert r.ok and r.content == "x" * 10 + PLACEHOLDER * 2 and r.images == ["0.png", "1.png"]
    assert r.message() == {"role": "tool", "name": "look", "content": r.content, "images": ["0.png", "1.png"]}
    [cut] = ToolSet([look], max_result_chars=10 + len(PLACEHOLDER) + 29).run(call("look", n=3))
    assert cut.truncated and cut.images == ["0.png", "1.png"]  # the second pad survives the cut, the third not
    [b] = ToolSet([bad]).run(call("bad"))
    assert not b.ok and 'an image part has no "image"' in b.content
    [m] = _check_messages([{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                        {"type": "text", "text": "hi"}]}], "step")
    assert m == {"role": "user", "content": PLACEHOLDER + "hi", "images": ["a.png"]}
