"""Reading GPT-OSS's Harmony format (OpenAI's chat format for gpt-oss): a completion's messages, and the text of its
`final` channel, which is what rewards read by default (`monorl.tasks.completions.completion_text`). Rendering and
tool calls are the agent's (`monorl.agent.harmony`).

A message is ``<|start|>{role}[ to={recipient}]<|channel|>{channel}[ to={recipient}][ <|constrain|>{format}]
<|message|>{content}`` ended by ``<|end|>``, ``<|call|>`` (a tool call) or ``<|return|>`` (the answer is done). A
completion sampled after the generation prompt ``<|start|>assistant`` begins at its first ``<|channel|>``."""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
_ENDS = (END, CALL, RETURN)
_ENDING = re.compile("|".join(map(re.escape, (*_ENDS, START))))


@dataclass(frozen=True)
class HarmonyMessage:
    role: str
    channel: str
    content: str
    recipient: str | None = None  # e.g. "functions.get_weather" for a tool call
    constrain: str | None = None  # the content's format ("json")
    ended_by: str = ""  # <|end|>, <|call|>, <|return|>, or "" (the text ran out)


def is_harmony(text: str) -> bool:
    return CHANNEL in text and MESSAGE in text


def parse_harmony(text: str, role: str = "assistant") -> list[HarmonyMessage]:
    """The messages of `text` (a completion after ``<|start|>assistant``, or whole rendered messages); `role` is
    the first message's when its header has none."""
    out: list[HarmonyMessage] = []
    pos = 0
    while (head_end := text.find(MESSAGE, pos)) >= 0:
        header = text[pos:head_end]
        if header.startswith(START):
            header = header[len(START):]
        body_end = _ENDING.search(text, head_end + len(MESSAGE))
        stop = body_end.start() if body_end else len(text)
        ended = body_end.group(0) if body_end and body_end.group(0) in _ENDS else ""
        who, _, rest = header.partition(CHANNEL)
        who_role, _, who_to = who.strip().partition(" to=")
        rest, _, constrain = rest.partition(CONSTRAIN)
        channel, _, to = rest.strip().partition(" to=")
        recipient = (to or who_to).strip() or None
        out.append(HarmonyMessage(who_role.strip() or role, channel.strip(), text[head_end + len(MESSAGE):stop],
                                  recipient, constrain.strip() or None, ended))
        pos = stop + len(ended)
    return out


def final_text(text: str) -> str:
    """The content of the last `final`-channel message of a Harmony completion ("" when it wrote none)."""
    finals = [m.content for m in parse_harmony(text) if m.channel == "final"]
    return finals[-1] if finals else ""
