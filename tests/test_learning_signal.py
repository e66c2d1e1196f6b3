"""Runs that learn nothing (#56): the tiny_tools preset's collapse to reward 0 and a dead run's stop.

The collapse: with `grpo`'s per-sequence mean, a token every episode of a group shares (the tool call's format) has the
net weight sum_s A_s / len_s on its log-prob, which is negative once the failed episodes are the short ones; on a
saturated token that push is tiny, Adam scales it up to a full step, and the format broke (`</tool_cal>`, reward 0 and
a zero gradient from then on, 2 of 2 seeds with one thread). A token-mean loss weights it sum_s A_s / N = 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from monorl.presets import preset
from monorl.rl.advantages import group_advantages
from monorl.rl.loop import GRPORun
from monorl.rl.stopping import NoLearningSignal, check_learning_signal
from monorl.train.losses import LossConfig, LossNorm, policy_loss
from tests.conftest import DigitsTask, digits_cfg


def shared_token_weight(cfg: LossConfig) -> float:
    """d loss / d log-prob of a token at the start of every sequence of one group, summed over its copies: two long
    successes (8 tokens, reward 1) and two short failures (2 tokens, reward 0), on-policy (ratio 1)."""
    lengths = [8, 8, 2, 2]
    adv = group_advantages([1.0, 1.0, 0.0, 0.0], group_size=4)
    seq_ids = torch.tensor([s for s, n in enumerate(lengths) for _ in range(n)])
    logprobs = torch.full((sum(lengths),), -0.1, requires_grad=True)
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, seq_ids, cfg, LossNorm.for_step(cfg, lengths))
    loss.backward()
    firsts = [sum(lengths[:s]) for s in range(len(lengths))]
    return float(logprobs.grad[firsts].sum())


def test_sequence_mean_pushes_shared_tokens_down_and_the_preset_does_not():
    assert shared_token_weight(LossConfig(kind="grpo")) > 0.1  # descent lowers the shared token's log-prob
    assert shared_token_weight(LossConfig(kind="token_grpo")) == pytest.approx(0.0, abs=1e-7)
    assert shared_token_weight(preset("tiny_tools").trainer.loss) == pytest.approx(0.0, abs=1e-7)


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
