"""`monorl report <run_dir>`: what a run did, from metrics.jsonl and config.json: one PNG (reward with its
components, smoothed, and the validation before and after; response length; time split; grad norm, clip
fraction and KL, the signals that move, where the on-policy loss is ~0 by construction) and a summary table.
matplotlib is imported only here (an optional dependency: without it the table alone, and a line saying so)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

MATPLOTLIB_HINT = "the plot needs matplotlib: pip install matplotlib (or 'monorl[report]')"
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
    lines = [f"{len(rows)} steps (step {rows[0]['step'] + 1} .. {rows[-1]['step'] + 1}, counted from 1 as the log "
             "prints them)", "",
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


def _smooth(values: list[float]) -> tuple[list[float], int]:
    """Trailing mean over a window of ~1/10 of the run (at least 2 steps), skipping NaNs; and the window."""
    w = max(2, len(values) // 10)
    out = []
    for i in range(len(values)):
        win = [v for v in values[max(0, i - w + 1): i + 1] if math.isfinite(v)]
        out.append(sum(win) / len(win) if win else math.nan)
    return out, w


def run_title(run_dir: str | os.PathLike) -> str:
    """What ran: model, task, preset (from the run's config.json; the directory alone when it has none)."""
    try:
        cfg = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
        model = cfg.get("model") or {}
        path = model.get("path")
        what = (f"{Path(path).name or path}" + (" (random init)" if model.get("random_init") else "")
                if path else f"random {model.get('shape')}")
        loss = ((cfg.get("trainer") or {}).get("loss") or {}).get("kind", "?")
        return (f"{what} | task {(cfg.get('task') or {}).get('name')} | preset {cfg.get('preset')} | "
                f"loss {loss} | {Path(run_dir).name}")
    except (OSError, ValueError, AttributeError):
        return str(run_dir)


def plot(rows: list[dict[str, Any]], out: str | os.PathLike, title: str = "",
         validation: dict[str, Any] | None = None) -> Path:
    """`figure`'s six panels to a PNG at `out`."""
    fig = figure(rows, title, validation)
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _validation_label(v: dict[str, Any]) -> str:
    """How a validation was measured: greedy (k = 1), or the mean over k sampled completions per prompt."""
    k = _num(v.get("k", 1))
    return f"mean of {int(k)} samples" if math.isfinite(k) and k > 1 else "greedy"


def figure(rows: list[dict[str, Any]], title: str = "", validation: dict[str, Any] | None = None) -> Any:
    """Six panels (a matplotlib Figure; the caller closes it): reward (components, smoothed, validation pre/post
    marked), response length and truncation, time split, grad norm, clip fractions, KL (or the generator-trainer
    log-prob gap)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MATPLOTLIB_HINT) from None
    matplotlib.use("Agg")  # files only: no display needed (servers, CI)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [int(r["step"]) + 1 for r in rows]  # 1-based, as the training log prints steps
    has = lambda k: any(math.isfinite(v) for v in _series(rows, k))  # noqa: E731
    fig, axes = plt.subplots(2, 3, figsize=(17, 9), constrained_layout=True)

    ax = axes[0][0]
    reward = _series(rows, "reward")
    ax.plot(x, reward, color="tab:blue", linewidth=1, alpha=0.35, label="reward (per step)")
    smooth, w = _smooth(reward)
    ax.plot(x, smooth, color="tab:blue", linewidth=2.5, label=f"reward, mean of {w} steps")
    for k in component_keys(rows):
        ax.plot(x, _smooth(_series(rows, k))[0], linewidth=1, alpha=0.9, linestyle="--",
                label=f"{k.split('/')[1]} (mean of {w})")
    if has("val/mean_reward"):  # validation.every: the held-out reward at the steps where it was measured
        ax.plot(x, _series(rows, "val/mean_reward"), "o", color="black", markersize=5, label="validation (periodic)")
    marks = [(0, "pre"), (x[-1], "post")]
    how = []
    for at, name in marks:  # validation on held-out prompts (greedy, or k samples each), before RL and after the end
        v = (validation or {}).get(f"validation/{name}")
        if isinstance(v, dict) and math.isfinite(_num(v.get("mean_reward"))):
            y = _num(v.get("mean_reward"))
            how.append(_validation_label(v))
            ax.plot([at], [y], marker="*", markersize=15, color="black", linestyle="none")
            ax.annotate(f"validation {name}\n{y:+.3f} ({how[-1]})", (at, y), textcoords="offset points", fontsize=9,
                        xytext=(8, 6) if name == "pre" else (-8, 6), ha="left" if name == "pre" else "right")
    measured = f" ({' / '.join(dict.fromkeys(how))})" if how else ""
    ax.set_title(f"reward (mean over rollouts); \u2605 validation{measured}")
    # below the panel: inside, it covered the post-validation label at the right end of the curve
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)

    ax = axes[0][1]
    ax.plot(x, _series(rows, "completions/mean_length"), color="tab:green", label="mean length")
    ax.set_title("response length (tokens)")
    if has("completions/clipped_ratio"):
        twin = ax.twinx()
        twin.plot(x, _series(rows, "completions/clipped_ratio"), color="tab:gray", linestyle=":",
                  label="truncated fraction")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("truncated fraction (at max_new_tokens)", fontsize=8)
        twin.legend(fontsize=8, loc="upper right")
    ax.legend(fontsize=8, loc="upper left")

    ax = axes[0][2]
    parts = [[0.0 if not math.isfinite(v) else v for v in _series(rows, k)] for k in TIME_KEYS]
    ax.stackplot(x, *parts, labels=[k.split("/")[1][:-2] for k in TIME_KEYS], alpha=0.8)
    ax.set_title("time per step (s)")
    ax.legend(fontsize=8, loc="upper right")

    ax = axes[1][0]
    ax.plot(x, _series(rows, "grad_norm"), color="tab:purple")
    ax.set_title("gradient norm (before clipping)")

    ax = axes[1][1]
    for k, style in (("clip_frac", "-"), ("clip_frac_low", "--"), ("clip_frac_high", ":")):
        if has(k):
            ax.plot(x, _series(rows, k), linestyle=style, label=k)
    ax.set_title("clipped fraction (ratio outside the clip range)")
    if ax.lines:
        ax.legend(fontsize=8)
    if has("clip_frac") and not any(v for v in _series(rows, "clip_frac") if math.isfinite(v)):
        ax.text(0.5, 0.6, "0 at every step: one optimizer step per batch of rollouts,\nso the ratio only measures "
                "the generator-trainer gap", transform=ax.transAxes, ha="center", fontsize=9, color="dimgray")

    ax = axes[1][2]
    if has("kl"):
        ax.plot(x, _series(rows, "kl"), color="tab:red", label="KL to reference")
        ax.set_title("KL to the reference policy")
    else:
        for k in ("logprob_diff_mean", "logprob_diff_max"):
            if has(k):
                ax.plot(x, [v if v > 0 else math.nan for v in _series(rows, k)], label=k)
        if ax.lines:
            ax.set_yscale("log")  # ~1e-7 (fp32 CPU) to ~1e-2 (bf16 GPU): orders of magnitude apart
        ax.set_title("|generator - trainer| log-prob (no KL term in this run)")
    if ax.lines:
        ax.legend(fontsize=8)

    for a in axes.flat:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=12)
    return fig


def report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> str:
    """Write the PNG (default `run_dir/report.png`) and return the summary table (with the PNG's path). Without
    matplotlib: the table and a line saying how to get the plot."""
    rows, validation = load_metrics(run_dir)
    title = run_title(run_dir)
    table = f"{title}\n{summary_table(rows, validation)}"
    try:
        png = plot(rows, out if out is not None else Path(run_dir) / "report.png", title=title, validation=validation)
    except ImportError as e:
        return f"{table}\nplot: skipped ({e})"
    return f"{table}\nplot: {png}"
