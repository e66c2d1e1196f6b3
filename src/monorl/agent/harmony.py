"""GPT-OSS's Harmony chat format for agentic episodes (`ChatRenderer` style "harmony"): conversations with tools ->
text, the text to insert after a sampled turn, and the tool calls of a completion. Parsing messages is
`monorl.tasks.harmony` (rewards read the `final` channel through it).

Rendered as OpenAI's Harmony spec writes it: a ``system`` message (identity, reasoning effort, the valid channels,
and with tools that calls go to the commentary channel), a ``developer`` message with the conversation's system
prompt under ``# Instructions`` and the tools as a TypeScript ``namespace functions``, then the turns::

    <|start|>user<|message|>{text}<|end|>
    <|start|>assistant<|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>
    <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>{result}<|end|>
    <|start|>assistant<|channel|>final<|message|>{answer}<|end|>
    <|start|>assistant                                     (the generation prompt)

A model's turn ends at ``<|call|>`` or ``<|return|>`` (both stop tokens). Its sampled text (everything after the
generation prompt, markup included) stays as it was sampled: an assistant message whose content starts with
``<|channel|>`` is rendered as ``<|start|>assistant`` + that text, so token in / token out holds."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from monorl.tasks.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START

SYSTEM = ("You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\n"
          "Reasoning: {reasoning}\n\n# Valid channels: analysis, commentary, final. Channel must be included for every "
          "message.")
TOOLS_LINE = "\nCalls to these tools must go to the commentary channel: 'functions'."
GENERATION_PROMPT = f"{START}assistant"
TURN_ENDS = (CALL, RETURN)


def _ts_type(schema: dict[str, Any]) -> str:
    """A JSON schema as the TypeScript type Harmony writes for it."""
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_ts_type({**schema, "type": k}) for k in kind)
    if kind == "array":
        return f"{_ts_type(schema.get('items', {}))}[]"
    if kind == "integer":
        return "number"
    if kind == "null":
        return "null"
    if kind in ("string", "number", "boolean"):
        return kind
    if kind == "object" and schema.get("properties"):
        return "{\n" + _ts_fields(schema) + "}"
    return "object" if kind == "object" else "any"


def _ts_fields(schema: dict[str, Any]) -> str:
    required = set(schema.get("required", []))
    lines = []
    for name, prop in schema.get("properties", {}).items():
        if prop.get("description"):
            lines.append(f"// {prop['description']}\n")
        value = prop.get("default")
        default = f" // default: {value if isinstance(value, str) else json.dumps(value)}" if "default" in prop else ""
        lines.append(f"{name}{'' if name in required else '?'}: {_ts_type(prop)},{default}\n")
    return "".join(lines)


def tools_namespace(tools: Sequence[dict[str, Any]]) -> str:
    """The developer message's ``# Tools`` section for OpenAI-style function schemas."""
    out = ["# Tools\n\n## functions\n\nnamespace functions {\n\n"]
    for tool in tools:
        fn = tool.get("function", tool)
        if fn.get("description"):
            out.append(f"// {fn['description']}\n")
        params = fn.get("parameters") or {}
        args = f"(_: {{\n{_ts_fields(params)}}})" if params.get("properties") else "()"
        out.append(f"type {fn['name']} = {args} => any;\n\n")
    out.append("} // namespace functions")
    return "".join(out)


def _message(role: str, content: str, channel: str | None = None, end: str = END) -> str:
    return f"{START}{role}{CHANNEL + channel if channel else ''}{MESSAGE}{content}{end}"


def _assistant(m: dict[str, Any]) -> str:
    content = m["content"]
    if content.startswith(CHANNEL):  # the model's own sampled text, as it sampled it
        return GENERATION_PROMPT + content + ("" if content.endswith((END, *TURN_ENDS)) else END)
    out = []
    if thinking := m.get("thinking") or m.get("reasoning_content"):
        out.append(_message("assistant", thinking, "analysis"))
    for call in m.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        to = f"commentary to=functions.{fn['name']} {CONSTRAIN}json"
        out.append(f"{START}assistant{CHANNEL}{to}{MESSAGE}{args}{CALL}")
    if content or not out:
        out.append(_message("assistant", content, "final"))
    return "".join(out)


def render_harmony(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                   add_generation_prompt: bool = True, header: bool = True, reasoning: str = "medium") -> str:
    """The text of a conversation (see the module docstring); header: the system and developer messages first
    (off for the messages inserted after a turn)."""
    out = []
    rest = list(messages)
    if header:
        instructions = []
        while rest and rest[0]["role"] in ("system", "developer"):
            instructions.append(rest.pop(0)["content"])
        out.append(_message("system", SYSTEM.format(reasoning=reasoning) + (TOOLS_LINE if tools else "")))
        developer = ([f"# Instructions\n\n{chr(10).join(instructions)}"] if instructions else []) + (
            [tools_namespace(tools)] if tools else [])
        if developer:
            out.append(_message("developer", "\n\n".join(developer)))
    for m in rest:
        role = m["role"]
        if role == "assistant":
            out.append(_assistant(m))
        elif role == "tool":
            out.append(_message(f"functions.{m.get('name', 'tool')} to=assistant", m["content"], "commentary"))
        else:
            out.append(_message(role, m["content"]))
    if add_generation_prompt:
        out.append(GENERATION_PROMPT)
    return "".join(out)


def harmony_delta(new_messages: Sequence[dict[str, Any]], closed: bool = True) -> str:
    """The text after a sampled assistant turn: ``<|end|>`` when the model did not end it itself (`closed`), the new
    messages, the next generation prompt."""
    return ("" if closed else END) + render_harmony(new_messages, header=False)
