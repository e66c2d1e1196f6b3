"""What a reward reads of a completion: its text, whatever form TRL's conventions hand it in."""

from __future__ import annotations

from typing import Any

from monorl.tasks.harmony import final_text, is_harmony


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or TRL's conversational form (a list of messages, the content of
    the last one). A Harmony completion (GPT-OSS) reads as its `final` channel's text (`monorl.tasks.harmony`)."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        completion = str(completion[-1].get("content", ""))
    if isinstance(completion, str):
        return final_text(completion) if is_harmony(completion) else completion
    raise TypeError(f"expected a completion string or a list of messages, got {type(completion).__name__}")
