"""A run that learns nothing stops (#56): the tiny_tools preset collapsed to reward 0 with a zero gradient on some
machines and then ran 20 more silent steps; now `stop_without_signal` steps without a learning signal end it with a
checkpoint and a one-line reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from monorl.rl.loop import GRPORun
from monorl.rl.stopping import NoLearningSignal, check_learning_signal
from tests.conftest import DigitsTask, digits_cfg


def _row(step: int, zero_std: float, grad_norm: float, reward: float = 0.0) -> dict:
    return {"step": step, "frac_reward_zero_std": zero_std, "grad_norm": grad_norm, "reward": reward}


def test_check_learning_signal():
    dead = [_row(i, 1.0, 0.0) for i in range(3)]
    with pytest.raises(NoLearningSignal, match="no learning signal for 3 steps in a row.*stopped after step 3"):
        check_learning_signal(dead, 3)
    check_learning_signal(dead[:2], 3)  # not yet
    check_learning_signal(dead, 0)  # 0: never
    check_learning_signal([*dead[:2], _row(2, 1.0, 0.3)], 3)  # equal rewards but a gradient (a KL term): learning
    check_learning_signal([*dead[:2], _row(2, 0.875, 0.0)], 3)  # one group varied


class ZeroTask(DigitsTask):
    """Every completion scores 0: no group ever varies."""

    def reward(self, prompt, completion):
        return {"digits": 0.0}


def test_a_run_without_signal_stops_with_a_checkpoint(tmp_path: Path):
    cfg = digits_cfg(tmp_path, steps=8)
    cfg.task.name = "tests.test_learning_signal:ZeroTask"
    run = GRPORun(cfg, progress=False)
    with pytest.raises(NoLearningSignal, match="mean reward \\+0.000"):
        run.run()
    run_dir = tmp_path / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r and "reward" in r] == [0, 1, 2]
    assert (run_dir / "checkpoints" / "step_000003").is_dir()
    assert "no learning signal" in json.loads((run_dir / "summary.json").read_text())["stopped"]
