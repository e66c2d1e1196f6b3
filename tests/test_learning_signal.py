"""A run that learns nothing stops (#56): the tiny_tools preset collapsed to reward 0 with a zero gradient on some
machines and then ran 20 more silent steps; now `stop_without_signal` steps without a learning signal end it with a
checkpoint and a one-line reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from monorl.run.grpo import GRPORun
from monorl.run.stopping import NoLearningSignal, check_learning_signal
from tests.conftest import DigitsTask, digits_cfg


def _row(step: int, zero_std: float, grad_norm: float, reward: float = 0.0) -> dict:
    return {"step": step, "frac_reward_zero_std": zero_std, "grad_norm": grad_norm, "reward": reward}


def test_check_learning_signal():
    alive, dead = _row(0, 0.5, 1.2, 0.4), [_row(i, 1.0, 0.0) for i in range(1, 4)]
    with pytest.raises(NoLearningSignal, match="no learning signal for 3 steps in a row.*stopped after step 4"):
        check_learning_signal([alive, *dead], 3)
    assert check_learning_signal([alive, *dead[:2]], 3) == ""  # not yet
    assert check_learning_signal([alive, *dead], 0) == ""  # 0: never
    assert check_learning_signal([alive, *dead[:2], _row(3, 1.0, 0.3)], 3) == ""  # equal rewards, a gradient (KL)
    assert check_learning_signal([alive, *dead[:2], _row(3, 0.875, 0.0)], 3) == ""  # one group varied
    # no signal since the start: a warning, once, and the run goes on
    never = [_row(i, 1.0, 0.0) for i in range(5)]
    assert check_learning_signal(never[:3], 3).startswith("warning: no learning signal in the first 3 steps")
    assert check_learning_signal(never, 3) == ""


def test_a_converged_run_goes_on_with_a_warning():
    """Gemma-3-270M's arith run (H100, 2026-12-07) reached steps with every group uniform, 14 of 16 groups all right
    and 2 all wrong: reward 0.94, gradient 0. That is convergence, not a collapse: a warning once, and the run goes
    on. Silent steps below the run's earlier reward still stop it."""
    before = [_row(i, 0.5, 1.0, r) for i, r in enumerate((0.2, 0.6, 0.8))]  # mean 0.53
    converged = [_row(i, 1.0, 0.0, 0.94) for i in range(3, 6)]
    line = check_learning_signal([*before, *converged], 3)
    assert line.startswith("warning: no learning signal for 3 steps in a row") and "converged" in line
    assert check_learning_signal([*before, *converged, _row(6, 1.0, 0.0, 0.9)], 3) == ""  # once per stretch
    collapsed = [_row(i, 1.0, 0.0, 0.1) for i in range(3, 6)]
    with pytest.raises(NoLearningSignal, match="below the mean reward of the steps before"):
        check_learning_signal([*before, *collapsed], 3)


class FadingTask(DigitsTask):
    """The digits reward for the first step's prompts (indices 0-3), then 0 for everything: a signal, then none."""

    def reward(self, prompt, completion):
        return super().reward(prompt, completion) if prompt.meta["index"] < 4 else {"digits": 0.0}


class ZeroTask(DigitsTask):
    """Every completion scores 0: no group ever varies."""

    def reward(self, prompt, completion):
        return {"digits": 0.0}


def test_a_run_that_loses_its_signal_stops_with_a_checkpoint(tmp_path: Path):
    cfg = digits_cfg(tmp_path, steps=8)
    cfg.task.name = "tests.test_learning_signal:FadingTask"
    run = GRPORun(cfg, progress=False)
    with pytest.raises(NoLearningSignal, match="mean reward \\+0.000"):
        run.run()
    run_dir = tmp_path / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step" in r and "reward" in r]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[0]["grad_norm"] > 0
    assert (run_dir / "checkpoints" / "step_000004").is_dir()
    assert "no learning signal" in json.loads((run_dir / "summary.json").read_text())["stopped"]


def test_a_run_without_any_signal_is_warned_about_and_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture):
    cfg = digits_cfg(tmp_path, steps=4)
    cfg.task.name = "tests.test_learning_signal:ZeroTask"
    assert len(GRPORun(cfg, progress=False).run().steps) == 4
    assert capsys.readouterr().out.count("warning: no learning signal in the first 3 steps") == 1
