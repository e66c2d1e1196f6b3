"""`monorl report`: metrics.jsonl -> PNG curves + a summary table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from monorl.cli import main
from monorl.presets import preset
from monorl.run.report import figure, load_metrics, plot, report, run_title, summary_table


def write_metrics(run_dir: Path) -> None:
    rows = []
    for s in range(5):
        rows.append({"step": s, "loss": 0.1 * s, "reward": 0.2 * s, "rewards/correctness/mean": 0.1 * s,
                     "rewards/format/mean": 0.1 * s, "completions/mean_length": 10.0 + s, "grad_norm": 1.0,
                     "time/generate_s": 1.0, "time/train_s": 3.0, "time/sync_s": 0.0, "time/step_s": 4.0})
    rows[4]["val/mean_reward"], rows[4]["val/pass@4"] = 0.5, 0.75  # validation.every
    rows.insert(3, {**rows[2], "reward": -9.0})  # step 2 logged twice: the later row wins
    lines = [json.dumps(r) for r in rows]
    lines.append(json.dumps({"validation/pre": {"mean_reward": 0.25, "components": {"correctness": 0.25},
                                                "mean_length": 7.0},
                             "validation/post": {"mean_reward": 0.75, "components": {"correctness": 0.75},
                                                 "mean_length": 6.0, "k": 4, "pass_at_k": 0.5,
                                                 "mean_at_k": 0.25}}))
    lines.append('{"step": 5, "loss": ')  # a line cut off by a kill
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_load_metrics(tmp_path: Path) -> None:
    write_metrics(tmp_path)
    rows, val = load_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[2]["reward"] == -9.0
    assert val["validation/post"]["mean_reward"] == 0.75


def test_summary_table(tmp_path: Path) -> None:
    write_metrics(tmp_path)
    table = summary_table(*load_metrics(tmp_path))
    lines = {ln.split()[0]: ln.split()[1:] for ln in table.splitlines() if ln.strip()}
    # first, last, min, max, mean
    assert [float(x) for x in lines["completions/mean_length"]] == [10, 14, 10, 14, 12]
    assert [float(x) for x in lines["reward"]] == [0, 0.8, -9, 0.8, pytest.approx((0 + 0.2 - 9 + 0.6 + 0.8) / 5)]
    assert "rewards/format/mean" in lines and [float(x) for x in lines["val/pass@4"]] == [0.75] * 5
    assert "time: 20.0s in steps: generate 5.0s (25%), train 15.0s (75%), sync 0.0s (0%)" in table
    assert ("validation (post): mean_reward=+0.750 (correctness=+0.750), mean_length=6.0, pass@4=0.500, "
            "mean@4=0.250") in table


def test_summary_table_reads_older_metric_names(tmp_path: Path) -> None:
    """metrics.jsonl of a run from before the TRL names (reward/<c>, response_length, truncated_frac)."""
    rows = [{"step": s, "loss": 0.0, "reward": 0.5, "reward/correctness": 0.5, "response_length": 10.0 + s,
             "truncated_frac": 0.25} for s in range(2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = {ln.split()[0]: ln.split()[1:] for ln in summary_table(*load_metrics(tmp_path)).splitlines() if ln.strip()}
    assert [float(x) for x in lines["completions/mean_length"]] == [10, 11, 10, 11, 10.5]
    assert "completions/clipped_ratio" in lines and "reward/correctness" in lines


def test_report_writes_png(tmp_path: Path, capsys) -> None:
    write_metrics(tmp_path / "run")
    text = report(tmp_path / "run")
    png = tmp_path / "run" / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in text
    out = tmp_path / "elsewhere" / "r.png"
    assert main(["report", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "completions/mean_length" in capsys.readouterr().out


def test_report_errors(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"validation/pre": {}}\n')
    with pytest.raises(ValueError, match="no step rows"):
        load_metrics(tmp_path)
    write_metrics(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot(load_metrics(tmp_path)[0], tmp_path / "x.png")
    # the Quick start install has no matplotlib: the table still comes, with one line saying how to get the plot
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "completions/mean_length" in out
    assert "plot: skipped (the plot needs matplotlib: pip install matplotlib" in out
    assert not (tmp_path / "report.png").exists()


def test_report_title_names_model_task_preset(tmp_path: Path) -> None:
    write_metrics(tmp_path / "run")
    cfg = preset("qwen3_0_6b_gsm8k")
    cfg.model.path = "/models/Qwen3-0.6B"
    (tmp_path / "run" / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert run_title(tmp_path / "run") == "Qwen3-0.6B | task gsm8k | preset qwen3_0_6b_gsm8k | loss dapo | run"
    assert report(tmp_path / "run").startswith("Qwen3-0.6B | task gsm8k")


def test_validation_marks_say_how_they_were_measured_and_the_legend_leaves_them_visible(tmp_path: Path) -> None:
    """Sampled validation (k = 4) was labelled "greedy", and the legend (lower right) covered the "validation post"
    label where the curve ends high and validation lands low."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rows = [{"step": s, "reward": 1.0, "rewards/correctness/mean": 1.0, "rewards/format/mean": 1.0} for s in range(20)]
    validation = {"validation/pre": {"mean_reward": 0.5, "components": {}, "mean_length": 5.0},
                  "validation/post": {"mean_reward": 0.0, "components": {}, "mean_length": 5.0, "k": 4,
                                      "pass_at_k": 0.5, "mean_at_k": 0.25}}
    fig = figure(rows, "t", validation)
    try:
        ax = fig.axes[0]
        labels = {t.get_text().split("\n")[0]: t for t in ax.texts}
        assert labels["validation post"].get_text() == "validation post\n+0.000 (mean of 4 samples)"
        assert labels["validation pre"].get_text() == "validation pre\n+0.500 (greedy)"
        assert ax.get_title() == "reward (mean over rollouts); \u2605 validation (greedy / mean of 4 samples)"
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legend = ax.get_legend().get_window_extent(renderer)
        assert not [t.get_text() for t in ax.texts if legend.overlaps(t.get_window_extent(renderer))]
    finally:
        plt.close(fig)
