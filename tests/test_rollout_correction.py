"""Rollout correction (TIS / MIS, token / sequence / geometric) against hand-computed values, in the trainer
(micro-batch shares, min / max) and in a short RL run."""

from __future__ import annotations

import math

import pytest
import torch

from monorl.cliargs import run_config
from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.train.losses import LOSS_KINDS, LossConfig, LossNorm, policy_loss
from monorl.train.packing import TrainSequence
from monorl.train.rollout_correction import RolloutCorrectionConfig
from monorl.train.trainer import Trainer, TrainerConfig
from tests.conftest import digits_cfg
from tests.test_frozen_logprobs import separately_packed_logprobs

LN2, LN3, LN4, LN15 = math.log(2.0), math.log(3.0), math.log(4.0), math.log(1.5)
# trainer log-probs (pi_old = this forward) all -1; the generator's make the IS weights pi_old / pi_rollout
# w = [3, 0.5, 1, 1.5] (sequence 0: tokens 0-1, sequence 1: tokens 2-3), advantages [1, -2]
LOGP = [-1.0] * 4
GEN = [-1.0 - LN3, -1.0 + LN2, -1.0, -1.0 - LN15]
ADV, SEQ_IDS, LENGTHS = [1.0, -2.0], [0, 0, 1, 1], [2, 2]


def _run(kind: str, gen=GEN, logp=LOGP, token_mask=None, **corr_kw):
    cfg = LossConfig(kind=kind, dr_grpo_norm=2.0, rollout_correction=RolloutCorrectionConfig(**corr_kw))
    lp = torch.tensor(logp, requires_grad=True)
    n = len(logp)
    seq_ids = torch.tensor(SEQ_IDS + [1] * (n - 4))
    mask = None if token_mask is None else torch.tensor(token_mask)
    loss, m = policy_loss(lp, torch.tensor(gen + [0.0] * (n - 4)), torch.tensor(ADV), seq_ids, cfg,
                          LossNorm.for_step(cfg, LENGTHS), token_mask=mask)
    loss.backward()
    return loss.item(), lp.grad, {k: v.item() for k, v in m.items()}


def test_token_tis_hand_computed():
    # factors min(w, 2) = [2, 0.5, 1, 1.5]; ratio 1, so each token's surrogate is -A: [-1, -1, 2, 2]
    # loss = (-2 - 0.5 + 2 + 3) / 4 = 0.625; d/dlogp_t = -A f_t / 4
    loss, grad, m = _run("token_grpo", rollout_is="token", rollout_is_threshold=2.0)
    assert loss == pytest.approx(0.625, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-0.5, -0.125, 0.5, 0.75]))
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.5, abs=1e-6)  # (3 + 0.5 + 1 + 1.5) / 4
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0, abs=1e-5)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.5, abs=1e-6)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.25  # the 3 was truncated
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert m["ratio_mean"] == 1.0 and m["clip_frac"] == 0.0  # the ratio is against the trainer's own log-probs


def test_token_mask_and_icepop_hand_computed():
    # rejection outside [0.6, 2]: tokens 0 (w 3) and 1 (w 0.5) dropped, no IS weight: loss (2 + 2) / 4 = 1
    loss, grad, m = _run("dapo", rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.6)
    assert loss == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 0.5, 0.5]))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.5
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0  # no IS weights, nothing truncated
    # IcePop: kept tokens also carry their weight (token 3: 1.5): loss (2 + 3) / 4
    loss, grad, _ = _run("dapo", rollout_is="token", rollout_is_threshold=5.0, rollout_rs="token",
                         rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.6)
    assert loss == pytest.approx(1.25, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 0.5, 0.75]))
    # the default lower bound is 1 / upper = 0.5, which keeps w = 0.5
    _, _, m = _run("dapo", rollout_rs="token", rollout_rs_threshold=2.0)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.25


def test_sequence_tis_on_grpo_hand_computed():
    # w = [3, 0.5 | 1, 4]: sequence weights prod = 1.5 and 4 -> min(., 2) = 1.5, 2. grpo's loss value is -mean A
    # (ratio 1) = 0.5; d/dlogp_t = -A_s f_s / (L_s S): seq 0 -1 * 1.5 / 4, seq 1 2 * 2 / 4
    gen = [-1.0 - LN3, -1.0 + LN2, -1.0, -1.0 - LN4]
    loss, grad, m = _run("grpo", gen=gen, rollout_is="sequence", rollout_is_threshold=2.0)
    assert loss == pytest.approx(0.5, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-0.375, -0.375, 1.0, 1.0]))
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(2.75, abs=1e-5)  # over sequences
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(4.0, abs=1e-5)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(1.5, abs=1e-5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5


def test_token_tis_inside_the_sequence_mean():
    # grpo with token weights [2, 0.5 | 1, 1.5]: d/dlogp_t = -A_s f_t / (L_s S)
    _, grad, _ = _run("grpo", rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(grad, torch.tensor([-0.5, -0.125, 0.5, 0.75]))


def test_geometric_mask_hand_computed():
    # geometric means: seq 0 sqrt(3 * 0.5) = 1.2247, seq 1 sqrt(1 * 4) = 2 > 1.5: sequence 1 is dropped
    gen = [-1.0 - LN3, -1.0 + LN2, -1.0, -1.0 - LN4]
    loss, grad, m = _run("token_grpo", gen=gen, rollout_rs="geometric", rollout_rs_threshold=1.5)
    assert loss == pytest.approx(-0.5, abs=1e-6)  # (-1 - 1) / 4
    torch.testing.assert_close(grad, torch.tensor([-0.25, -0.25, 0.0, 0.0]))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.5  # tokens
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((math.sqrt(1.5) + 2.0) / 2, abs=1e-5)


def test_cispo_with_token_tis():
    # cispo: -sg(clip(r)) f A logp / 4 with r = 1, logp = -1: -(2 * -1 + 0.5 * -1 + 1 * 2 + 1.5 * 2) / 4
    loss, grad, _ = _run("cispo", rollout_is="token", rollout_is_threshold=2.0)
    assert loss == pytest.approx(-0.625, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-0.5, -0.125, 0.5, 0.75]))


def test_padded_rows_are_ignored_even_when_not_finite():
    logp = LOGP + [float("-inf")]
    loss, grad, m = _run("token_grpo", logp=logp, token_mask=[1.0, 1.0, 1.0, 1.0, 0.0], rollout_is="sequence",
                         rollout_rs="token", rollout_rs_threshold=10.0)
    ref_loss, ref_grad, ref_m = _run("token_grpo", rollout_is="sequence", rollout_rs="token",
                                     rollout_rs_threshold=10.0)
    assert loss == pytest.approx(ref_loss, abs=1e-6) and grad[4] == 0.0
    torch.testing.assert_close(grad[:4], ref_grad)
    assert m == pytest.approx(ref_m)


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_no_mismatch_means_no_correction(kind):
    """With generator log-probs equal to the trainer's (batch-invariant mode), every correction is the identity:
    the same loss and gradient as with it off."""
    logp = [-1.0, -2.0, -0.5, -3.0]
    off = _run(kind, gen=logp, logp=logp)
    for kw in ({"rollout_is": "token"}, {"rollout_is": "sequence", "rollout_rs": "geometric"}):
        on = _run(kind, gen=logp, logp=logp, **kw)
        assert on[0] == pytest.approx(off[0], abs=1e-7)
        torch.testing.assert_close(on[1], off[1], rtol=0, atol=1e-7)
        assert on[2]["rollout_corr/rollout_is_mean"] == 1.0 and on[2]["rollout_corr/rollout_rs_masked_fraction"] == 0


def test_config_validation_and_overrides():
    with pytest.raises(ValueError, match="rollout_is must be none or one of"):
        RolloutCorrectionConfig(rollout_is="seq")
    with pytest.raises(ValueError, match="rollout_rs_threshold_lower < rollout_rs_threshold"):
        RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0)
    assert not LossConfig().rollout_correction.enabled  # off by default
    cfg = run_config("tiny", {"trainer.loss.rollout_correction.rollout_is": "geometric",
                              "trainer.loss.rollout_correction.rollout_is_threshold": "3"})
    rc = cfg.trainer.loss.rollout_correction
    assert rc.rollout_is == "geometric" and rc.rollout_is_threshold == 3.0 and rc.enabled


def _shifted_seqs() -> list[TrainSequence]:
    """Sequences whose generator log-probs are the model's own shifted by known per-token offsets."""
    model = build_model(model_shape("tiny"), seed=3)
    g = torch.Generator().manual_seed(0)
    seqs = [TrainSequence(torch.randint(3, 100, (4 + i,), generator=g).tolist(),
                          torch.randint(3, 100, (3 + i % 4,), generator=g).tolist(), [0.0] * (3 + i % 4),
                          float(i % 3 - 1)) for i in range(6)]
    tr = Trainer(model, TrainerConfig(micro_batch_tokens=4096), total_steps=1)
    own = separately_packed_logprobs(tr, model, seqs, 1.0)  # the model's own log-probs
    offsets = [0.0, -LN2, LN3, 0.1, -0.1, 0.0]  # log w = -offset at token 0 of sequence i
    for s, lp, off in zip(seqs, own, offsets, strict=True):
        s.old_logprobs = [lp[0] + off] + lp[1:]
    return seqs


def test_trainer_metrics_are_exact_over_micro_batches():
    """In the trainer: the step's IS weights are the hand-set offsets (min 1/3, max 2), whatever the pack
    split, and the update is the same from one micro-batch or many."""
    corr = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token",
                                   rollout_rs_threshold=2.5, rollout_rs_threshold_lower=0.5)
    steps = []
    for budget in (24, 4096):
        model = build_model(model_shape("tiny"), seed=3)
        tr = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_tokens=budget, loss=LossConfig(
            kind="token_grpo", rollout_correction=corr)), total_steps=2)
        steps.append((tr.step(_shifted_seqs()), [p.detach().clone() for p in model.parameters()]))
    (many, w_many), (one, w_one) = steps
    assert many["micro_batches"] > 1 and one["micro_batches"] == 1
    tokens = sum(3 + i % 4 for i in range(6))
    assert one["rollout_corr/rollout_is_max"] == pytest.approx(2.0, rel=1e-4)
    assert one["rollout_corr/rollout_is_min"] == pytest.approx(1 / 3, rel=1e-4)
    assert one["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / tokens)  # the 2 is truncated
    assert one["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / tokens)  # the 1/3 is masked
    mean = (tokens - 5 + 2 + 1 / 3 + math.exp(-0.1) + math.exp(0.1) + 1) / tokens
    assert one["rollout_corr/rollout_is_mean"] == pytest.approx(mean, rel=1e-4)
    for k, v in one.items():
        if k.startswith("rollout_corr/") or k in ("loss", "grad_norm"):
            assert many[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    for a, b in zip(w_many, w_one, strict=True):
        # Adam normalises each gradient: a weight whose gradient is near the micro-batches' rounding noise may move
        # by a visible part of its 1e-3 step (one of 16,384 moved 1.05e-5 on one CPU); a wrong sum moves ~1e-3
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
        assert (a - b).abs().mean() < 1e-6


def test_short_run_with_correction_trains(tmp_path):
    cfg = digits_cfg(tmp_path, steps=2)
    cfg.trainer.loss.rollout_correction = RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="token",
                                                                  rollout_rs_threshold=2.0)
    from monorl.run.grpo import GRPORun

    run = GRPORun(cfg, progress=False)
    before = [p.detach().clone() for p in run.policy.parameters()]
    result = run.run()
    assert any(not torch.equal(a, b) for a, b in zip(before, run.policy.parameters(), strict=True))
    for row in result.steps:
        assert math.isfinite(row["loss"]) and row["grad_norm"] > 0 and row["skipped"] == 0.0
        # fp32 on CPU: generator and trainer agree to ~1e-5, so the weights are 1 within that, nothing masked
        lo, mean, hi = (row[f"rollout_corr/rollout_is_{k}"] for k in ("min", "mean", "max"))
        assert 0.999 < lo <= mean <= hi < 1.001
        assert row["rollout_corr/rollout_rs_masked_fraction"] == 0.0


@pytest.mark.parametrize("cap", [None, 2.0])
def test_token_correction_is_decoupled_ppo(cap):
    """Stale rollouts (rollout.max_staleness > 0) train with the decoupled PPO objective (Hilton et al. 2021,
    "Batch size-invariance for policy optimization"; AReaL, Fu et al. 2025, arXiv:2505.24298, eq. 5): per token
    (pi_prox / pi_behav) * min(u A, clip(u, 1 - eps, 1 + eps) A) with u = pi_theta / pi_prox, token-mean; the
    proximal policy is the trainer's current one (one update per batch: pi_prox = sg(pi_theta)), and AReaL's
    behav_imp_weight_cap drops tokens whose weight exceeds the cap. The rollout correction at token level is
    that objective: untruncated IS (threshold inf), plus rejection above the cap (lower bound 0) for AReaL's form."""
    logp = [-0.7, -1.9, -0.2, -1.1, -2.5]
    behav = [-0.9, -1.2, -0.2, -2.4, -2.0]  # the stale generator's log-probs
    adv, seq_ids, lengths = [0.8, -1.3], [0, 0, 0, 1, 1], [3, 2]
    kw = {"rollout_is": "token", "rollout_is_threshold": 1e9}  # above e^log_ratio_clamp: untruncated
    if cap is not None:
        kw.update(rollout_rs="token", rollout_rs_threshold=cap, rollout_rs_threshold_lower=0.0)
    cfg = LossConfig(kind="token_grpo", rollout_correction=RolloutCorrectionConfig(**kw))
    lp = torch.tensor(logp, requires_grad=True)
    loss, _ = policy_loss(lp, torch.tensor(behav), torch.tensor(adv), torch.tensor(seq_ids), cfg,
                          LossNorm.for_step(cfg, lengths))
    loss.backward()

    theta = torch.tensor(logp, requires_grad=True)
    prox = torch.tensor(logp)  # the trainer's current policy, a constant
    w = torch.exp(prox - torch.tensor(behav))
    if cap is not None:  # AReaL: behav_mask = behav_imp_weight <= cap
        w = torch.where(w <= cap, w, 0.0)
    u = torch.exp(theta - prox)
    a = torch.tensor(adv)[torch.tensor(seq_ids)]
    eps = 0.2
    objective = (w * torch.minimum(u * a, u.clamp(1 - eps, 1 + eps) * a)).sum() / len(logp)
    (-objective).backward()
    assert loss.item() == pytest.approx(-objective.item(), abs=1e-6)
    torch.testing.assert_close(lp.grad, theta.grad)
    if cap is not None:  # token 3 (w = e^1.3 = 3.7) is dropped, token 0 (w = 1.22) is not
        assert theta.grad[3] == 0 and theta.grad[0] != 0
