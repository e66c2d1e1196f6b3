"""What one episode did (`EpisodeRecord`) and a step's metrics over its episodes (`episode_metrics`).

Names follow TRL's GRPO trainer where it has them (``tools/call_frequency``: tool calls per episode,
``tools/failure_frequency``: failed calls / calls, as `GRPOTrainer._tool_call_loop` logs them); the rest are
monorl's: per tool ``tools/<name>/calls`` and ``tools/<name>/failure_frequency`` (calls that name no tool the
episode has count as ``unknown_tool``, unparsable ones as ``malformed_call``), ``episodes/*`` for turns, time
spent in tools and environments, why episodes stopped and how many environments failed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Why an episode ended other than by the model or environment finishing it.
TRUNCATIONS = ("max_turns", "length", "env_error")


@dataclass
class EpisodeRecord:
    """One episode: assistant turns, tool calls and failures per tool, seconds in tools and in the environment
    (reset / step / reward), and `truncation` (one of TRUNCATIONS, None when it ended normally); `error` is the
    environment's failure, if any."""

    turns: int = 0
    tool_calls: Counter = field(default_factory=Counter)
    tool_failures: Counter = field(default_factory=Counter)
    tool_seconds: float = 0.0
    env_seconds: float = 0.0
    truncation: str | None = None
    error: str | None = None

    @property
    def failed(self) -> bool:
        """The environment failed (its episode scores 0 on every component: `safe_score_episode`)."""
        return self.error is not None

    def add_tool_results(self, results: Iterable[Any]) -> None:
        for r in results:
            self.tool_calls[r.counted_as] += 1
            self.tool_failures[r.counted_as] += 0 if r.ok else 1
            self.tool_seconds += r.seconds

    def to_dict(self) -> dict[str, Any]:
        return {"turns": self.turns, "tool_calls": dict(self.tool_calls), "tool_failures": dict(self.tool_failures),
                "tool_seconds": self.tool_seconds, "env_seconds": self.env_seconds, "truncation": self.truncation,
                "error": self.error}


def episode_metrics(records: Sequence[EpisodeRecord]) -> dict[str, float]:
    """A metrics row's agent keys over a step's episodes (empty when there are none)."""
    n = len(records)
    if n == 0:
        return {}
    calls, failures = Counter(), Counter()
    for r in records:
        calls.update(r.tool_calls)
        failures.update(r.tool_failures)
    total_calls, total_failures = sum(calls.values()), sum(failures.values())
    out = {
        "tools/call_frequency": total_calls / n,
        "tools/failure_frequency": total_failures / total_calls if total_calls else 0.0,
        "episodes/turns_mean": sum(r.turns for r in records) / n,
        "episodes/turns_max": float(max(r.turns for r in records)),
        "episodes/tool_seconds_mean": sum(r.tool_seconds for r in records) / n,
        "episodes/env_seconds_mean": sum(r.env_seconds for r in records) / n,
        "episodes/env_failure_ratio": sum(r.failed for r in records) / n,
    }
    for reason in TRUNCATIONS:
        out[f"episodes/truncated_{reason}_ratio"] = sum(r.truncation == reason for r in records) / n
    for name in sorted(calls):
        out[f"tools/{name}/calls"] = calls[name] / n
        out[f"tools/{name}/failure_frequency"] = failures[name] / calls[name]
    return out
