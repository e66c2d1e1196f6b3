"""The run directory: resolved config, metrics JSONL, rollout samples JSONL, checkpoints."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from monorl.console import record_to, stop_recording
from monorl.fsutil import json_safe, write_text_atomic
from monorl.rl.loggers import MetricLogger, scalars
from monorl.run.checkpoints.files import no_checkpoint_hint, resumable

CONFIG_FILE = "config.json"


class RunDir:
    def __init__(self, path: str | Path, writer: bool = True) -> None:
        """writer=False: the run's other ranks, which know the paths (they write checkpoint shards there) but
        write no logs (rank 0 alone writes the run directory)."""
        self.path = Path(path)
        self.writer = writer
        if writer:
            self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        self.samples_path = self.path / "samples.jsonl"
        self.checkpoints = self.path / "checkpoints"
        self.loggers: list[MetricLogger] = []  # TensorBoard / W&B: every metrics row goes to them too
        self.console_log = record_to(self.path) if writer else None  # the console's lines, kept whatever it does

    @staticmethod
    def check_new(path: str | Path) -> None:
        """Refuse to start a fresh run in a directory that holds a run: it would overwrite that run's config and
        final checkpoint and mix two runs' metrics. An empty or unrelated directory is fine."""
        p = Path(path)
        marks = [name for name in (CONFIG_FILE, "metrics.jsonl", "checkpoints") if (p / name).exists()]
        if marks and not resumable(p):
            raise ValueError(f"run_dir {p} already holds a run ({', '.join(marks)}): {no_checkpoint_hint(p)}")
        if marks:
            raise ValueError(f"run_dir {p} already holds a run ({', '.join(marks)}): continue it with "
                             f"`monorl train --resume {p}`, or give a new --run_dir (or remove that directory)")

    @staticmethod
    def default_path(preset: str) -> Path:
        return Path("runs") / f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"

    def write_config(self, cfg: dict[str, Any]) -> None:
        if not self.writer:
            return
        (self.path / CONFIG_FILE).write_text(json.dumps(json_safe(cfg), indent=2, sort_keys=True, default=str) + "\n")

    def _append(self, path: Path, rows: list[dict[str, Any]]) -> None:
        if not self.writer:
            return
        with path.open("a") as f:
            for r in rows:
                f.write(json.dumps(json_safe(r)) + "\n")
            f.flush()

    def log_metrics(self, row: dict[str, Any], step: int | None = None) -> None:
        """Append a row to metrics.jsonl and send its numbers to the loggers at `step` (default: a step row's
        1-based step, as the console counts; validation rows need it given)."""
        self._append(self.metrics_path, [row])
        if self.loggers:
            flat = scalars(row)
            at = step if step is not None else int(row["step"]) + 1
            for lg in self.loggers:
                lg.log(flat, at)

    def close(self) -> None:
        """Close the loggers and stop copying the console to console.log."""
        for lg in self.loggers:
            lg.close()
        self.loggers = []
        stop_recording(self.console_log)
        self.console_log = None

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        self._append(self.samples_path, rows)

    def rewind(self, step: int) -> list[dict[str, Any]]:
        """Drop the log rows of steps >= `step` and the post-validation row (a run resumed at step index `step`
        logs them again); returns the metrics rows of the steps kept."""
        if not self.writer:
            return []
        rows = truncate_jsonl(self.metrics_path, lambda r: r.get("step", -1) < step and "validation/post" not in r)
        truncate_jsonl(self.samples_path, lambda r: r.get("step", -1) < step)
        return [r for r in rows if "step" in r]


def truncate_jsonl(path: str | os.PathLike, keep: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """Rewrite a JSONL log with only the rows `keep` accepts (a resume drops rows logged after the checkpoint
    it continues from, and a last line cut off by a kill); returns the kept rows. Atomic (temp + rename)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a partial line from a killed write
        if isinstance(row, dict) and keep(row):
            rows.append(row)
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows
