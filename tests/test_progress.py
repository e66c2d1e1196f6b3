"""A run says where it is when piped (a line per step with ETA, warm-start lines), checkpoints by time as well as
by steps, and SIGTERM / Ctrl-C between steps leave a checkpoint and the command that resumes it."""

from __future__ import annotations

import json
import os
import signal

from monorl.cli import main
from monorl.run.checkpoints.files import step_checkpoints
from monorl.run.summary import format_duration
from monorl.run.trainer_steps import TrainerSteps
from tests.test_cli_errors import FAST

NO_CKPT = ["--checkpoint.every", "0", "--checkpoint.every_minutes", "0"]


def test_format_duration():
    assert [format_duration(s) for s in (4.4, 65, 3600 + 4 * 60 + 9)] == ["4s", "1m05s", "1h04m"]


def test_piped_run_prints_progress_and_checkpoints_by_time(tmp_path, capsys):
    run = tmp_path / "run"
    # every_minutes ~0: every step is past due
    assert main(["train", *FAST, "--steps", "3", "--warm_start.steps", "2", "--warm_start.batch_size", "2",
                 "--checkpoint.every_minutes", "1e-9",
                 "--checkpoint.keep_last", "5", "--run_dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "warm start 2/2 | loss " in out  # not a tty: lines, not a bar
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(steps) == 3 and all(" | eta " in ln for ln in steps) and steps[-1].endswith("| eta 0s")
    assert [s for s, _ in step_checkpoints(run / "checkpoints")] == [1, 2, 3]


def test_sigterm_finishes_the_step_checkpoints_and_says_how_to_resume(tmp_path, monkeypatch, capsys):
    step = TrainerSteps.step

    def terminated_during_second(self, i):
        if i == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step: the step still completes
        return step(self, i)

    monkeypatch.setattr(TrainerSteps, "step", terminated_during_second)
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "3", *NO_CKPT, "--run_dir", str(run)]) == 130
    err = capsys.readouterr().err
    assert "SIGTERM: stopping after the step under way" in err
    assert "stopped by SIGTERM after 2/3 steps" in err and "step_000002" in err
    assert f"monorl train --resume {run}" in err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    monkeypatch.setattr(TrainerSteps, "step", step)
    assert main(["train", "--resume", str(run)]) == 0
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [0, 1, 2]
