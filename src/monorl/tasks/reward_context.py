"""What a reward may know about the run and where it may log: the RL loop's side of TRL's reward-function extras.

TRL 1.16 passes every reward function ``trainer_state`` (the trainer's state: ``global_step``, ``max_steps``,
``epoch``, ...), ``log_metric(name, value)`` (a scalar, averaged over the step's calls and logged under ``name``) and
``log_extra(column, values)`` (one value per completion: a column of the completions table). The loop makes one
`RewardContext` per step and hands it to the task's `score_batch` (`monorl.tasks.dataset` turns it into those
arguments); what the rewards logged comes back through it: `metric_means` into the step's metrics row,
`take_columns` into each rollout's samples.jsonl row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class RewardFunctionError(ValueError):
    """A reward function (or a task's score_batch) returned something of the wrong shape or type: a bug in user
    code, raised at once as one line naming the function, never counted as a failed completion."""


@dataclass
class TrainerState:
    """The fields of transformers' ``TrainerState`` that TRL's reward functions read as ``trainer_state``."""

    global_step: int = 0  # RL steps completed before this batch (0 during the first step)
    max_steps: int = 0  # the run's RL steps (0 outside a training run: `monorl eval`)
    epoch: float = 0.0  # passes over the training data completed before this step (fractional)


@dataclass
class RewardContext:
    """One step's context for the task's rewards (see the module docstring). `metrics` and `columns` are the
    sinks: `metrics` gathers log_metric's values over the step (every generation round, every rank), `columns`
    log_extra's values of the batch being scored, which `take_columns` hands over and clears after each call."""

    global_step: int = 0  # RL steps completed before this step
    max_steps: int = 0  # the run's RL steps (0: not a training run)
    data_position: int = 0  # training prompts drawn before this step (a task with a finite dataset: its epoch)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def fresh(self) -> RewardContext:
        """The same run position, empty sinks (what one scoring call logs, before it is merged)."""
        return RewardContext(self.global_step, self.max_steps, self.data_position)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a scalar for this batch; the step's row gets the mean of the step's values."""
        if not isinstance(name, str) or not name:
            raise RewardFunctionError(f"log_metric: the name must be a non-empty str, got {name!r}")
        if isinstance(value, str | bytes) or not _is_number(value):
            raise RewardFunctionError(f"log_metric({name!r}) got {type(value).__name__} {value!r}; log a number")
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list[Any], size: int | None = None) -> None:
        """TRL's ``log_extra``: one value per completion of the batch (`size`, when the caller knows it), a column
        of each completion's samples.jsonl row (``extra``). A column logged twice in a batch keeps the last."""
        if not isinstance(column, str) or not column:
            raise RewardFunctionError(f"log_extra: the column must be a non-empty str, got {column!r}")
        if isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
            raise RewardFunctionError(f"log_extra({column!r}) got {type(values).__name__}; log a list with one "
                                      "value per completion")
        if size is not None and len(values) != size:
            raise RewardFunctionError(f"log_extra({column!r}) got {len(values)} values for {size} completions")
        self.columns[column] = list(values)

    def take_columns(self, size: int) -> list[dict[str, Any]]:
        """The logged columns as one dict per completion of a batch of `size` (empty dicts when none were logged),
        and the column sink cleared for the next batch."""
        rows: list[dict[str, Any]] = [{} for _ in range(size)]
        for column, values in self.columns.items():
            for row, v in zip(rows, values, strict=False):
                row[column] = v
        self.columns = {}
        return rows

    def add_metrics(self, metrics: dict[str, list[float]]) -> None:
        for name, values in metrics.items():
            self.metrics.setdefault(name, []).extend(values)

    def metric_means(self) -> dict[str, float]:
        """Each logged metric's mean over the step (TRL: the sum over calls and ranks over the count)."""
        return {name: sum(vals) / len(vals) for name, vals in self.metrics.items() if vals}


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True

