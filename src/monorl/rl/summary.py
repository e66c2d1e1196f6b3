"""What a run reports while it runs and when it ends: validation results, the metrics and sample rows of a
step and its log line, and summary.json (the time split the benchmarks read). `monorl report` (rl/report.py)
reads these back afterwards."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from monorl.compile import compile_counters, compile_phase_times
from monorl.rl.rollouts import Rollout

if TYPE_CHECKING:
    from monorl.train.trainer import Trainer


@dataclass
class ValidationResult:
    mean_reward: float
    components: dict[str, float]
    mean_length: float

    def line(self) -> str:
        comps = ", ".join(f"{k}={v:+.3f}" for k, v in self.components.items())
        return f"mean_reward={self.mean_reward:+.3f} ({comps})"


@dataclass
class RunResult:
    run_dir: Path
    pre: ValidationResult | None
    post: ValidationResult | None
    steps: list[dict[str, Any]] = field(default_factory=list)
    startup: dict[str, float] = field(default_factory=dict)


def summarize(groups: list[list[Rollout]], components: tuple[str, ...]) -> ValidationResult:
    flat = [r for g in groups for r in g]
    if not flat:
        return ValidationResult(0.0, {c: 0.0 for c in components}, 0.0)
    comps = {c: sum(r.rewards.get(c, 0.0) for r in flat) / len(flat) for c in components}
    return ValidationResult(sum(r.reward for r in flat) / len(flat), comps,
                            sum(len(r.completion_ids) for r in flat) / len(flat))


# ---- one step ------------------------------------------------------------------------------------------

def step_metrics(step: int, groups: list[list[Rollout]], components: tuple[str, ...], train: dict[str, float],
                 times: dict[str, float]) -> dict[str, Any]:
    """The step's metrics.jsonl row: reward and length of its rollouts, the trainer's metrics, and `times`
    (seconds per stage) as `time/<stage>`."""
    rollouts = [r for g in groups for r in g]
    s = summarize(groups, components)
    return {
        "step": step, "loss": train["loss"], "reward": s.mean_reward,
        **{f"reward/{k}": v for k, v in s.components.items()},
        "response_length": s.mean_length,
        "truncated_frac": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
        **{k: v for k, v in train.items() if k != "loss"},
        **{f"time/{k}": v for k, v in times.items()},
    }


def sample_rows(step: int, rollouts: list[Rollout]) -> list[dict[str, Any]]:
    """samples.jsonl rows: what was asked, what was answered, and how it scored."""
    return [{"step": step, "prompt": r.prompt.text, "completion": r.text, "rewards": r.rewards,
             "advantage": r.advantage, "finish_reason": r.finish_reason} for r in rollouts]


def step_line(row: dict[str, Any], steps: int, eta_s: float | None = None) -> str:
    """The console line of a step (1-based, as the run's other output counts), with the time left when known."""
    comps = ", ".join(f"{k.split('/', 1)[1]}={v:+.3f}" for k, v in row.items() if k.startswith("reward/"))
    line = (f"step {row['step'] + 1}/{steps} | loss {row['loss']:+.4f} | reward {row['reward']:+.3f} ({comps}) | "
            f"len {row['response_length']:.1f} | logprob_diff {row['logprob_diff_mean']:.2e}/"
            f"{row['logprob_diff_max']:.2e} | gen {row['time/generate_s']:.2f}s train {row['time/train_s']:.2f}s "
            f"sync {row['time/sync_s']:.3f}s")
    return line if eta_s is None else f"{line} | eta {format_duration(eta_s)}"


def format_duration(seconds: float) -> str:
    """12s, 3m05s, 2h04m."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


# ---- the end of a run ----------------------------------------------------------------------------------

def trainer_graph_stats(trainer: Trainer) -> dict[str, float] | None:
    """Trainer CUDA graphs: how many shapes were captured (in warm-up and lazily in steps), in how long, and
    how many micro-batches replayed one."""
    g = trainer.graphs
    return None if g is None else {"captured": len(g.graphs), "capture_s": g.capture_s, "replays": g.replays}


def compile_roi(compile_s: float, eager_step_s: float | None, rows: list[dict[str, Any]]) -> str | None:
    """Compile time spent, and with a measured eager step time, the per-step saving and break-even."""
    if not compile_s:
        return None
    times = sorted(r["time/step_s"] for r in rows[1:] if "time/step_s" in r) or [float("nan")]
    step_s = times[len(times) // 2]
    line = f"compile: {compile_s:.1f}s spent; steady-state step {step_s:.3f}s"
    if eager_step_s:
        saved = eager_step_s - step_s
        even = f"break-even after {compile_s / saved:.1f} steps" if saved > 0 else "never breaks even"
        line += f"; eager step {eager_step_s:.3f}s -> saves {saved:.3f}s/step, {even}"
    return line


def write_summary(file: Path, result: RunResult, *, phases: dict[str, float], wall_s: float, compile_s: float,
                  trainer: Trainer, device: torch.device) -> None:
    """summary.json: the time split the benchmarks read. total_s = startup + the RL steps (generate, train,
    sync); `phases` (warm start, validation, checkpoint writes) are reported beside it."""
    rows = [r for r in result.steps if "time/step_s" in r]
    steps = sorted(r["time/step_s"] for r in rows)
    startup = sum(result.startup.values())
    split = {k: sum(r[f"time/{k}"] for r in rows) for k in ("generate_s", "train_s", "sync_s")}
    summary = {
        "startup": result.startup, "startup_s": startup, **split,
        "steps": len(rows), "total_s": startup + sum(split.values()),
        "steady_step_s": steps[len(steps) // 2] if steps else None,
        "first_step_s": rows[0]["time/step_s"] if rows else None,
        **phases, "wall_s": wall_s,
        "compile_s": compile_s, "compile_counters": compile_counters(),
        "trainer_graphs": trainer_graph_stats(trainer), "compile_phases": compile_phase_times(),
        "logprob_diff_max": max((r["logprob_diff_max"] for r in rows), default=None),
        "pre": result.pre.__dict__ if result.pre else None, "post": result.post.__dict__ if result.post else None,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    file.write_text(json.dumps(summary, indent=2, default=str) + "\n")
