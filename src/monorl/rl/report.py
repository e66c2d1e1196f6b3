"""`monorl report <run_dir>`: reward, response length, loss and time-split curves from metrics.jsonl to one
PNG, and a summary table on stdout. matplotlib is imported only here (an optional dependency)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

TIME_KEYS = ("time/generate_s", "time/train_s", "time/sync_s")
TABLE_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
              "entropy", "loss", "kl", "clip_ratio/region_mean", "grad_norm", "logprob_diff_mean",
              "throughput/tokens_per_s", "time/generate_s", "time/train_s", "time/sync_s", "time/step_s")
# metrics.jsonl of runs from before the TRL names: new key -> the key those rows hold
LEGACY_KEYS = {"completions/mean_length": "response_length", "completions/clipped_ratio": "truncated_frac",
               "learning_rate": "lr"}


def component_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The per-reward-component keys of the rows: rewards/<c>/mean (and reward/<c> of older runs)."""
    return sorted({k for r in rows for k in r
                   if (k.startswith("rewards/") and k.endswith("/mean")) or k.startswith("reward/")})


def load_metrics(run_dir: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(per-step rows sorted by step, the last validation row or {}) from `run_dir/metrics.jsonl`. A step
    logged twice keeps its last row; unparsable lines (a write cut off by a kill) are skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"no metrics to report: {path} does not exist")
    steps: dict[int, dict[str, Any]] = {}
    validation: dict[str, Any] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict):
            continue
        if "step" in row:
            steps[int(row["step"])] = row
        elif any(k.startswith("validation/") for k in row):
            validation = row
    if not steps:
        raise ValueError(f"no step rows in {path}")
    return [steps[k] for k in sorted(steps)], validation


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [_num(r.get(key, r.get(LEGACY_KEYS.get(key, key)))) for r in rows]


def summary_table(rows: list[dict[str, Any]], validation: dict[str, Any] | None = None) -> str:
    """A plain-text table: first / last / min / max / mean of the main metrics, time split, validation."""
    comps = component_keys(rows)
    val = sorted({k for r in rows for k in r if k.startswith("val/") and ("@" in k or k == "val/mean_reward")})
    keys = [k for k in (TABLE_KEYS[0], *comps, *TABLE_KEYS[1:], *val)
            if any(k in r or LEGACY_KEYS.get(k) in r for r in rows)]
    width = max(len(k) for k in keys)
    lines = [f"{len(rows)} steps (step {rows[0]['step']} .. {rows[-1]['step']})", "",
             f"{'metric':<{width}}  {'first':>10} {'last':>10} {'min':>10} {'max':>10} {'mean':>10}"]
    for k in keys:
        vals = [v for v in _series(rows, k) if math.isfinite(v)]
        if not vals:
            continue
        first, last = vals[0], vals[-1]
        stats = (first, last, min(vals), max(vals), sum(vals) / len(vals))
        lines.append(f"{k:<{width}}  " + " ".join(f"{v:>10.4g}" for v in stats))
    totals = {k: sum(v for v in _series(rows, k) if math.isfinite(v)) for k in TIME_KEYS}
    all_s = sum(totals.values())
    if all_s > 0:
        split = ", ".join(f"{k.split('/')[1][:-2]} {v:.1f}s ({100 * v / all_s:.0f}%)" for k, v in totals.items())
        lines += ["", f"time: {all_s:.1f}s in steps: {split}"]
    for name in ("pre", "post"):
        v = (validation or {}).get(f"validation/{name}")
        if isinstance(v, dict):
            comp = ", ".join(f"{c}={_num(x):+.3f}" for c, x in (v.get("components") or {}).items())
            k = v.get("k", 1)
            passes = (f", pass@{k}={_num(v['pass_at_k']):.3f}, mean@{k}={_num(v.get('mean_at_k')):.3f}"
                      if v.get("pass_at_k") is not None else "")
            lines.append(f"validation ({name}): mean_reward={_num(v.get('mean_reward')):+.3f} ({comp}), "
                         f"mean_length={_num(v.get('mean_length')):.1f}{passes}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: str | os.PathLike, title: str = "") -> Path:
    """Four panels (reward + components, response length, loss, stacked time split) to a PNG at `out`."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("monorl report needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: no display needed (servers, CI)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [int(r["step"]) + 1 for r in rows]  # 1-based, as the training log prints steps
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    ax = axes[0][0]
    ax.plot(x, _series(rows, "reward"), label="reward", linewidth=2)
    for k in component_keys(rows):
        ax.plot(x, _series(rows, k), label=k.split("/")[1], linewidth=1, alpha=0.8)
    if any("val/mean_reward" in r for r in rows):  # validation.every: the held-out reward, where measured
        ax.plot(x, _series(rows, "val/mean_reward"), "o", label="validation", color="black")
    ax.set_title("reward (mean over rollouts)")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.plot(x, _series(rows, "completions/mean_length"), color="tab:green")
    ax.set_title("response length (tokens)")
    ax = axes[1][0]
    ax.plot(x, _series(rows, "loss"), color="tab:red")
    ax.set_title("loss")
    ax = axes[1][1]
    parts = [[0.0 if not math.isfinite(v) else v for v in _series(rows, k)] for k in TIME_KEYS]
    ax.stackplot(x, *parts, labels=[k.split("/")[1][:-2] for k in TIME_KEYS], alpha=0.8)
    ax.set_title("time per step (s)")
    ax.legend(fontsize=8, loc="upper right")
    for a in axes.flat:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> str:
    """Write the PNG (default `run_dir/report.png`) and return the summary table (with the PNG's path)."""
    rows, validation = load_metrics(run_dir)
    png = plot(rows, out if out is not None else Path(run_dir) / "report.png", title=str(run_dir))
    return f"{summary_table(rows, validation)}\nplot: {png}"
