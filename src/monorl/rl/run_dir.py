"""The run directory: resolved config, metrics JSONL, rollout samples JSONL, checkpoints."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        self.samples_path = self.path / "samples.jsonl"
        self.checkpoints = self.path / "checkpoints"

    @staticmethod
    def default_path(preset: str) -> Path:
        return Path("runs") / f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"

    def write_config(self, cfg: dict[str, Any]) -> None:
        (self.path / "config.json").write_text(json.dumps(_clean(cfg), indent=2, sort_keys=True, default=str) + "\n")

    def _append(self, path: Path, rows: list[dict[str, Any]]) -> None:
        with path.open("a") as f:
            for r in rows:
                f.write(json.dumps(_clean(r)) + "\n")
            f.flush()

    def log_metrics(self, row: dict[str, Any]) -> None:
        self._append(self.metrics_path, [row])

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        self._append(self.samples_path, rows)
