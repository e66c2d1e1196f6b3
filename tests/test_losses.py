import math

import pytest
import torch

from monorl.train.losses import LossConfig, LossNorm, policy_loss

LN2, LN15 = math.log(2.0), math.log(1.5)


def _run(kind, logp, old, adv, seq_ids, lengths, ref=None, **cfg_kw):
    cfg = LossConfig(kind=kind, **cfg_kw)
    lp = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    loss, metrics = policy_loss(lp, torch.tensor(old), torch.tensor(adv), torch.tensor(seq_ids), cfg,
                                LossNorm.for_step(cfg, lengths), None if ref is None else torch.tensor(ref))
    loss.backward()
    return loss.item(), lp.grad, metrics


# -- seq-level GRPO ---------------------------------------------------------------------------------------------

def test_grpo_hand_computed_both_clip_sides():
    # seq 0: log-ratios +0.2, -0.2 -> mean 0 -> r = 1, A = 1 -> loss -1 (unclipped)
    # seq 1: log-ratio ln 1.5 -> r = 1.5 > 1.2, A = 2 -> min(3.0, 2.4) = 2.4 -> loss -2.4 (clipped high)
    # seq 2: log-ratios ln 0.5 (both) -> r = 0.5 < 0.8, A = -1 -> min(-0.5, -0.8) = -0.8 -> loss 0.8 (clipped low)
    logp = [-1.0, -2.0, -0.5, -1.0, -1.0]
    old = [-1.2, -1.8, -0.5 - LN15, -1.0 + LN2, -1.0 + LN2]
    loss, grad, m = _run("grpo", logp, old, [1.0, 2.0, -1.0], [0, 0, 1, 2, 2], [2, 1, 2])
    assert loss == pytest.approx((-1.0 - 2.4 + 0.8) / 3, abs=1e-6)
    # only seq 0 is unclipped: d/dlogp_t of -(1/3) * A * exp(mean) = -(1/3) * 1 * 1 * (1/2) per token
    torch.testing.assert_close(grad, torch.tensor([-1 / 6, -1 / 6, 0.0, 0.0, 0.0]))
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    assert m["ratio_mean"].item() == pytest.approx((1.0 + 1.5 + 0.5) / 3, abs=1e-6)
    assert "kl" not in m


def test_grpo_clip_does_not_hold_back_the_pessimistic_side():
    # A < 0 with r = 1.5 > 1.2: min(-1.5, -1.2) = -1.5, unclipped: loss 1.5, gradient -A * r / L = 1.5 / 2
    loss, grad, m = _run("grpo", [-1.0, -1.0], [-1.0 - LN15, -1.0 - LN15], [-1.0], [0, 0], [2])
    assert loss == pytest.approx(1.5, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([0.75, 0.75]))
    assert m["clip_frac_high"].item() == 1.0


def test_grpo_ratio_one_is_minus_mean_advantage():
    adv = [0.5, -1.5, 2.0]
    loss, grad, _ = _run("grpo", [-1.0, -2.0, -3.0, -4.0], [-1.0, -2.0, -3.0, -4.0], adv, [0, 1, 1, 2], [1, 2, 1])
    assert loss == pytest.approx(-(0.5 - 1.5 + 2.0) / 3, abs=1e-7)
    # d/dlogp_t = -A_s / (S * L_s)
    torch.testing.assert_close(grad, torch.tensor([-0.5 / 3, 1.5 / 6, 1.5 / 6, -2.0 / 3]))


def test_grpo_kl_is_per_sequence_mean_then_mean():
    # ratio 1, advantages cancel: only the KL is left. ref - logp: seq 0 [ln 2, 0], seq 1 [-ln 2]
    # k3(ln 2) = 1 - ln 2, k3(0) = 0, k3(-ln 2) = ln 2 - 0.5 -> ((1 - ln 2) / 2 + ln 2 - 0.5) / 2 = ln 2 / 4
    logp = [-1.0, -1.0, -1.0]
    ref = [-1.0 + LN2, -1.0, -1.0 - LN2]
    loss, _, m = _run("grpo", logp, logp, [1.0, -1.0], [0, 0, 1], [2, 1], ref=ref, kl_coef=0.1)
    assert m["kl"].item() == pytest.approx(LN2 / 4, abs=1e-6)
    assert m["pg_loss"].item() == pytest.approx(0.0, abs=1e-7)
    assert loss == pytest.approx(0.1 * LN2 / 4, abs=1e-7)


# -- token-level kinds ------------------------------------------------------------------------------------------

TOKENS = dict(
    # t0 seq0 A=1  r=e^0.1 (inside)           -> -1.1051709
    # t1 seq0 A=1  r=1.5 (clipped to 1+high)  -> -(1 + high)
    # t2 seq1 A=-2 r=0.5: min(-1, -1.6)       -> 1.6
    # t3 seq1 A=-2 r=1                        -> 2.0
    logp=[-1.0, -1.0, -1.0, -1.0],
    old=[-1.1, -1.0 - LN15, -1.0 + LN2, -1.0],
    adv=[1.0, -2.0],
    seq_ids=[0, 0, 1, 1],
    lengths=[2, 2],
)
E01 = 1.1051709180756477


def test_token_grpo_hand_computed():
    loss, grad, m = _run("token_grpo", **TOKENS)
    assert loss == pytest.approx((-E01 - 1.2 + 1.6 + 2.0) / 4, abs=1e-6)
    # gradient -A * r / N where unclipped (t0, t3), 0 where clipped (t1, t2)
    torch.testing.assert_close(grad, torch.tensor([-E01 / 4, 0.0, 0.0, 2.0 / 4]))
    assert m["clip_frac_high"].item() == 0.25 and m["clip_frac_low"].item() == 0.25


def test_dapo_uses_clip_higher():
    assert LossConfig(kind="dapo").ceiling == 0.28
    assert LossConfig(kind="token_grpo").ceiling == 0.2
    loss, _, _ = _run("dapo", **TOKENS)
    assert loss == pytest.approx((-E01 - 1.28 + 1.6 + 2.0) / 4, abs=1e-6)


def test_dr_grpo_constant_normaliser():
    loss, grad, _ = _run("dr_grpo", **TOKENS, dr_grpo_norm=10)
    # the same per-token sum, divided by S * norm = 2 * 10
    assert loss == pytest.approx((-E01 - 1.2 + 1.6 + 2.0) / 20, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-E01 / 20, 0.0, 0.0, 2.0 / 20]))


def test_token_kl_mean_over_step_tokens():
    logp = [-1.0, -1.0, -1.0]
    ref = [-1.0 + LN2, -1.0, -1.0 - LN2]  # k3 sum = (1 - ln 2) + 0 + (ln 2 - 0.5) = 0.5
    loss, _, m = _run("token_grpo", logp, logp, [0.0, 0.0], [0, 0, 1], [2, 1], ref=ref, kl_coef=0.5)
    assert m["kl"].item() == pytest.approx(0.5 / 3, abs=1e-6)
    assert loss == pytest.approx(0.5 * 0.5 / 3, abs=1e-6)


def test_dual_clip_caps_negative_advantage_loss():
    # A = -1, r = 5: PPO loss max(5, 1.2) = 5; dual clip 3 caps it at 3 (and its gradient is 0)
    loss, grad, _ = _run("token_grpo", [-1.0], [-1.0 - math.log(5.0)], [-1.0], [0], [1], dual_clip=3.0)
    assert loss == pytest.approx(3.0, abs=1e-5)
    assert grad.item() == 0.0
    loss, _, _ = _run("token_grpo", [-1.0], [-1.0 - math.log(5.0)], [-1.0], [0], [1])
    assert loss == pytest.approx(5.0, abs=1e-5)


def test_minus_inf_generator_logprob_stays_finite():
    loss, grad, _ = _run("token_grpo", [-1.0, -1.0], [float("-inf"), -1.0], [1.0], [0, 0], [2])
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    assert loss == pytest.approx((-1.2 - 1.0) / 2, abs=1e-6)


@pytest.mark.parametrize("kind", ["grpo", "token_grpo", "dapo", "dr_grpo"])
def test_zero_advantage_gives_zero_loss_and_grad(kind):
    loss, grad, _ = _run(kind, [-1.0, -2.0, -0.3], [-1.5, -1.0, -0.2], [0.0, 0.0], [0, 0, 1], [2, 1],
                         dr_grpo_norm=4.0 if kind == "dr_grpo" else None)
    assert loss == 0.0
    assert (grad == 0).all()


# -- gradient accumulation --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, cfg_kw, scale", [
    ("grpo", {}, 1.0), ("token_grpo", {}, 1.0), ("dapo", {}, 1.0), ("dr_grpo", {}, 1.0),
    ("gspo", {}, 1e-3),  # log-ratios of the size GSPO's tiny clip range sees
    ("gspo", {"kl_estimator": "k1"}, 1e-3),
    ("cispo", {}, 1.0),
    ("cispo", {"clip_low": 0.2, "kl_estimator": "k2"}, 1.0),
    ("grpo", {"kl_estimator": "k2"}, 1.0),
    ("token_grpo", {"kl_estimator": "k1", "kl_in_loss": False}, 1.0),
])
def test_micro_batches_sum_to_full_batch(kind, cfg_kw, scale):
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2, 4, 0, 6]  # one empty response
    S, N = len(lengths), sum(lengths)
    seq_ids = torch.repeat_interleave(torch.arange(S), torch.tensor(lengths))
    base = -torch.rand(N, generator=g) * 3
    # ratios well outside [0.8, 1.2] for some tokens, and (per-sequence offsets) for some sequences
    old = base + scale * 0.3 * torch.randn(N, generator=g) + scale * 0.4 * torch.randn(S, generator=g)[seq_ids]
    ref = base + 0.2 * torch.randn(N, generator=g)
    adv = torch.randn(S, generator=g)
    cfg = LossConfig(kind=kind, kl_coef=0.05, dr_grpo_norm=8.0 if kind == "dr_grpo" else None, **cfg_kw)
    norm = LossNorm.for_step(cfg, lengths)

    full_lp = base.clone().requires_grad_(True)
    full_loss, full_m = policy_loss(full_lp, old, adv, seq_ids, cfg, norm, ref)
    full_loss.backward()

    # whole sequences, in a different order, split over three micro-batches
    groups = [[4, 0], [2, 5], [6, 1, 3]]
    acc_grad = torch.zeros(N)
    acc_loss = 0.0
    acc_m = {k: 0.0 for k in full_m}
    for grp in groups:
        idx = torch.cat([torch.nonzero(seq_ids == s).flatten() for s in grp])
        lp = base[idx].clone().requires_grad_(True)
        loss, m = policy_loss(lp, old[idx], adv, seq_ids[idx], cfg, norm, ref[idx])
        loss.backward()
        acc_grad[idx] += lp.grad
        acc_loss += loss.item()
        for k in acc_m:
            acc_m[k] += m[k].item()
    assert acc_loss == pytest.approx(full_loss.item(), abs=1e-6)
    torch.testing.assert_close(acc_grad, full_lp.grad)
    for k in full_m:
        assert acc_m[k] == pytest.approx(full_m[k].item(), abs=1e-6), k
    assert 0 < full_m["clip_frac"].item() < 1  # the data really exercises clipping


def test_loss_norm_counts():
    cfg = LossConfig(kind="grpo")
    n = LossNorm.for_step(cfg, [3, 0, 2])
    assert (n.num_tokens, n.num_seqs, n.denom) == (5, 2, 2.0)
    assert LossNorm.for_step(LossConfig(kind="dapo"), [3, 0, 2]).denom == 5.0
    assert LossNorm.for_step(LossConfig(kind="dr_grpo", dr_grpo_norm=16), [3, 0, 2]).denom == 48.0
    assert LossNorm.for_step(cfg, [0, 0]).denom == 1.0  # empty step: 0 loss, not 0/0
    with pytest.raises(ValueError, match=">= 0"):
        LossNorm.for_step(cfg, [1, -1])


def test_config_validation():
    with pytest.raises(ValueError, match="kind"):
        LossConfig(kind="ppo")
    with pytest.raises(ValueError, match="clip_low"):
        LossConfig(clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high"):
        LossConfig(clip_high=-0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        LossConfig(kl_coef=-1)
    with pytest.raises(ValueError, match="dr_grpo_norm"):  # the constant is needed once the step is normalised
        LossNorm.for_step(LossConfig(kind="dr_grpo"), [3, 2])
    with pytest.raises(ValueError, match="dr_grpo_norm"):
        LossConfig(kind="dr_grpo", dr_grpo_norm=0)
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)


def test_input_validation():
    cfg = LossConfig()
    norm = LossNorm.for_step(cfg, [2])
    lp = torch.zeros(2)
    with pytest.raises(ValueError, match="equal 1-D"):
        policy_loss(lp, torch.zeros(3), torch.zeros(1), torch.zeros(2, dtype=torch.long), cfg, norm)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lp, torch.zeros(2), torch.zeros(2, dtype=torch.long), cfg, norm)
    with pytest.raises(TypeError, match="int64"):
        policy_loss(lp, lp, torch.zeros(1), torch.zeros(2, dtype=torch.int32), cfg, norm)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, torch.zeros(1), torch.zeros(2, dtype=torch.long), LossConfig(kl_coef=0.1), norm)
