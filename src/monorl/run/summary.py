"""What a run reports while it runs and when it ends: the metrics and sample rows of a step and its log line, and
summary.json (the time split the benchmarks read). `monorl report` (run/report.py) reads these back afterwards.
The rollout metrics it builds on are `rl/rollouts/metrics.py`'s."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from monorl.compile import compile_counters, compile_phase_times
from monorl.rl.rollouts.metrics import ValidationResult, completion_metrics, fmt_value, reward_metrics
from monorl.rl.rollouts.rollout import Rollout

if TYPE_CHECKING:
    from monorl.train.trainer import Trainer


@dataclass
class RunResult:
    run_dir: Path
    pre: ValidationResult | None
    post: ValidationResult | None
    steps: list[dict[str, Any]] = field(default_factory=list)
    startup: dict[str, float] = field(default_factory=dict)


def step_metrics(step: int, groups: list[list[Rollout]], components: tuple[str, ...], train: dict[str, float],
                 times: dict[str, float], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The step's metrics.jsonl row, named as TRL's GRPOTrainer names them where it has the metric: reward and
    completion metrics of the rollouts trained on, the trainer's metrics (loss, entropy, kl, clip_ratio/*,
    grad_norm, learning_rate, ...), `extra` (the loop's: num_tokens, dynamic_sampling/*, ...; it overrides),
    `times` (seconds per stage) as `time/<stage>`, and tokens per second."""
    rollouts = [r for g in groups for r in g]
    completion_tokens = sum(len(r.completion_ids) for r in rollouts)
    tokens = completion_tokens + sum(len(r.prompt_ids) for r in rollouts)
    return {
        "step": step, "loss": train["loss"],
        **reward_metrics(groups, components),
        **completion_metrics(rollouts),
        **{k: v for k, v in train.items() if k != "loss"},
        **(extra or {}),
        **{f"time/{k}": v for k, v in times.items()},
        # throughput: the step's prompt + completion tokens over its wall time; generated tokens over generation
        "throughput/tokens_per_s": tokens / times["step_s"] if times.get("step_s") else 0.0,
        "throughput/generate_tokens_per_s": completion_tokens / times["generate_s"] if times.get("generate_s") else 0.0,
    }


def sample_rows(step: int, rollouts: list[Rollout]) -> list[dict[str, Any]]:
    """samples.jsonl rows: what was asked, what was answered (the text the reward saw: special tokens skipped),
    how it scored, and what the reward logged for it (`extra`: log_extra's columns, when it logged any; a value
    JSON cannot hold as its repr)."""
    rows = []
    for r in rollouts:
        row = {"step": step, "prompt": r.prompt.text, "completion": r.text, "rewards": r.rewards,
               "advantage": r.advantage, "finish_reason": r.finish_reason}
        if r.extra:
            row["extra"] = {k: _json_value(v) for k, v in r.extra.items()}
        rows.append(row)
    return rows


def _json_value(v: Any) -> Any:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)
    return v


def step_line(row: dict[str, Any], steps: int, eta_s: float | None = None) -> str:
    """The console line of a step (1-based, as the run's other output counts), with the time left when known."""
    comps = ", ".join(f"{k.split('/')[1]}={fmt_value(v)}" for k, v in row.items()
                      if k.startswith("rewards/") and k.endswith("/mean"))
    sampling = (f" | groups {row['dynamic_sampling/groups']} ({row['dynamic_sampling/dropped_groups']} dropped, "
                f"{row['dynamic_sampling/rounds']} rounds)" if "dynamic_sampling/rounds" in row else "")
    val = "".join(f" | {k} {v:.3f}" for k, v in row.items()
                  if k.startswith("val/") and ("pass@" in k or k == "val/mean_reward"))
    line = (f"step {row['step'] + 1}/{steps} | loss {row['loss']:+.4f} | reward {row['reward']:+.3f} ({comps}) | "
            f"len {row['completions/mean_length']:.1f} | entropy {row.get('entropy', 0.0):.3f} | logprob_diff "
            f"{row['logprob_diff_mean']:.2e}/{row['logprob_diff_max']:.2e} | gen {row['time/generate_s']:.2f}s "
            f"train {row['time/train_s']:.2f}s sync {row['time/sync_s']:.3f}s{sampling}{val}")
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
    times = sorted(r["time/step_s"] for r in rows[1:] if "time/step_s" in r)
    if not times:  # 0 or 1 steps: no step after the first to call steady
        return f"compile: {compile_s:.1f}s spent"
    step_s = times[len(times) // 2]
    line = f"compile: {compile_s:.1f}s spent; steady-state step {step_s:.3f}s"
    if eager_step_s:
        saved = eager_step_s - step_s
        even = f"break-even after {compile_s / saved:.1f} steps" if saved > 0 else "never breaks even"
        line += f"; eager step {eager_step_s:.3f}s -> saves {saved:.3f}s/step, {even}"
    return line


def write_summary(file: Path, result: RunResult, *, phases: dict[str, float], wall_s: float, compile_s: float,
                  trainer: Trainer, device: torch.device, memory: dict[str, Any] | None = None,
                  stopped: str | None = None) -> None:
    """summary.json: the time split the benchmarks read. total_s = startup + the RL steps (generate, train,
    sync); `phases` (warm start, validation, checkpoint writes) are reported beside it; `stopped`: why a run
    ended early (null: it ran its steps)."""
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
        # validation.every: the step (1-based: after it) and the val/ metrics of each validation between pre and post
        "validations": [{"step": r["step"] + 1, **{k.removeprefix("val/"): v for k, v in r.items()
                                                   if k.startswith("val/")}}
                        for r in result.steps if any(k.startswith("val/") for k in r)],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "memory": memory,
        "stopped": stopped,
    }
    file.write_text(json.dumps(summary, indent=2, default=str) + "\n")
