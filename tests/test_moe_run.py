"""GRPO on a tiny random Qwen3-MoE through the RL loop (its generator, trainer, weight sync, checkpoints): the run
completes with finite losses, the routers' load-balancing loss joins the loss when asked, and in batch-invariant
mode the generator's log-probs equal the trainer's (routing included) at every step."""

from __future__ import annotations

import math

import pytest
import torch

from monorl.model.hf_checkpoint import load_checkpoint
from monorl.run.grpo import GRPORun
from tests.conftest import digits_cfg


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_grpo_on_a_tiny_moe(tmp_path, batch_invariant):
    cfg = digits_cfg(tmp_path, steps=2)
    cfg.device, cfg.model.shape, cfg.batch_invariant = "cpu", "tiny-moe", batch_invariant
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 2, 4, 8
    cfg.validation.num_prompts = 2
    cfg.trainer.router_aux_loss = not batch_invariant
    run = GRPORun(cfg, progress=False)
    routers = [p.detach().clone() for n, p in run.policy.named_parameters() if n.endswith("mlp.gate.weight")]
    result = run.run()
    assert len(result.steps) == 2
    for row in result.steps:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["skipped"] == 0.0
        assert 0.0 <= row["moe/routing_mismatch"] <= 1.0  # both copies' routing of the step's tokens, checked
        if batch_invariant:
            assert row["logprob_diff_max"] == 0.0
            assert row["moe/routing_mismatch"] == 0.0 and row["moe/routing_mismatch_layers"] == 0.0
        else:
            assert row["logprob_diff_max"] < 1e-4
            assert 0.9 < row["moe/aux_loss"] < 8.0  # E * sum(f * P): 1 when balanced, E at worst
    after = [p for n, p in run.policy.named_parameters() if n.endswith("mlp.gate.weight")]
    assert any(not torch.equal(a, b) for a, b in zip(routers, after, strict=True))  # the routers train
    final = load_checkpoint(tmp_path / "run" / "checkpoints" / "final")  # per-expert names, read back stacked
    for (name, p), q in zip(run.policy.named_parameters(), final.parameters(), strict=True):
        assert torch.equal(p.detach(), q), name


def test_router_aux_loss_needs_experts():
    from monorl.model.config import model_shape
    from monorl.model.decoder import build_model
    from monorl.train.trainer import Trainer, TrainerConfig

    with pytest.raises(ValueError, match="router_aux_loss needs a mixture-of-experts model"):
        Trainer(build_model(model_shape("tiny")), TrainerConfig(router_aux_loss=True), total_steps=1)
