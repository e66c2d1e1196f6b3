"""What a reward reads of a completion: its text, whatever form TRL's conventions hand it in."""

from __future__ import annotations

from typing import Any


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or TRL's conversational form (a list of messages, the content of
    the last one)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"expected a completion string or a list of messages, got {type(completion).__name__}")
