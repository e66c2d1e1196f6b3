"""Metrics beyond metrics.jsonl: TensorBoard event files and Weights & Biases, each an optional extra. `RunDir`
forwards every row it logs (step metrics, validation results) to the loggers a run opened; each also gets the
run's config. Steps are counted as the console prints them: metrics of RL step N (1-based) at step N,
validation before RL at 0 and after the last step at the steps done."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from monorl.fsutil import install_hint


@dataclass
class LoggingSection:
    """Where metrics go besides run_dir/metrics.jsonl (each also receives the config and validation results)."""

    tensorboard: bool = False  # TensorBoard events under run_dir/tensorboard (pip install 'monorl[tensorboard]')
    wandb: bool = False  # Weights & Biases (pip install 'monorl[wandb]'; WANDB_MODE=offline logs to disk only)
    wandb_project: str = "monorl"  # W&B project
    wandb_name: str | None = None  # W&B run name (default: the run directory's name)
    wandb_tags: tuple[str, ...] = ()  # W&B run tags, e.g. [gsm8k,dapo]


class MetricLogger(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row, flat: a validation entry {"validation/pre": {"mean_reward": .., "components":
    {"c": ..}}} becomes validation/mean_reward, validation/reward/c, ... (one series across pre, periodic and post);
    the step index itself is not a metric."""
    def leaves(d: dict[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
        for k, v in d.items():
            if isinstance(v, dict):
                yield from leaves(v, f"{prefix}{k}/")
            else:
                yield prefix + k, v

    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "step":
            continue
        if key.startswith("validation/") and isinstance(value, dict):
            value = {("reward" if k == "components" else k): v for k, v in value.items()}
            key = "validation"
        for k, v in leaves({key: value}, ""):
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                out[k] = float(v)
    return out


class TensorBoardLogger:
    def __init__(self, log_dir: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))
        # the config as a text summary (the TEXT tab): the resolved config, as config.json holds it
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # a killed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, name: str | None,
                 tags: tuple[str, ...]) -> None:
        import wandb

        # one W&B run per run directory: a resumed run continues it (its id is kept beside the metrics)
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=name or run_dir.name, tags=list(tags), config=config,
                              dir=str(run_dir), id=run_id, resume="allow")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def check_loggers(cfg: LoggingSection) -> None:
    """Raise ImportError naming the extra to install, before a run creates anything."""
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
        except ImportError:
            raise ImportError(f"logging.tensorboard needs tensorboard: {install_hint('tensorboard')}") from None
    if cfg.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ImportError(f"logging.wandb needs wandb: {install_hint('wandb')}") from None


def open_loggers(cfg: LoggingSection, run_dir: Path, config: dict[str, Any]) -> list[MetricLogger]:
    check_loggers(cfg)
    loggers: list[MetricLogger] = []
    if cfg.tensorboard:
        loggers.append(TensorBoardLogger(run_dir / "tensorboard", config))
    if cfg.wandb:
        loggers.append(WandbLogger(run_dir, config, cfg.wandb_project, cfg.wandb_name, cfg.wandb_tags))
    return loggers
