"""Issue 15's algorithms, against hand-computed numbers: the GSPO and CISPO losses, the k1/k2/k3 KL estimators
and metric-only KL, the RLOO and REINFORCE++ advantages and the config key that picks them."""

import math

import pytest
import torch

from monorl.cliargs import run_config
from monorl.config import RolloutSection, RunConfig
from monorl.presets import preset
from monorl.rl.advantages import (
    ADVANTAGE_KINDS,
    compute_advantages,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from monorl.rl.rollouts.rollout import Rollout, assign_advantages
from monorl.train.losses import LossConfig, LossNorm, policy_loss

LN2, LN15 = math.log(2.0), math.log(1.5)
E01 = 1.1051709180756477  # e^0.1


def _run(kind, logp, old, adv, seq_ids, lengths, ref=None, token_mask=None, **cfg_kw):
    cfg = LossConfig(kind=kind, **cfg_kw)
    lp = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    loss, metrics = policy_loss(lp, torch.tensor(old), torch.tensor(adv), torch.tensor(seq_ids), cfg,
                                LossNorm.for_step(cfg, lengths), None if ref is None else torch.tensor(ref),
                                None if token_mask is None else torch.tensor(token_mask))
    loss.backward()
    return loss.item(), lp.grad, metrics


# -- GSPO -------------------------------------------------------------------------------------------------------

def test_gspo_defaults_are_the_papers_clip_ranges():
    cfg = LossConfig(kind="gspo")
    assert (cfg.floor, cfg.ceiling) == (3e-4, 4e-4)
    assert (LossConfig(kind="grpo").floor, LossConfig(kind="grpo").ceiling) == (0.2, 0.2)  # unchanged
    assert LossConfig(kind="gspo", clip_low=0.1, clip_high=0.3).floor == 0.1  # configurable as before
    assert LossConfig(kind="gspo", clip_low=0.1, clip_high=0.3).ceiling == 0.3


GSPO = dict(
    # seq 0: log-ratios +3e-4, -1e-4 -> mean 1e-4 -> s = e^1e-4 in [1 - 3e-4, 1 + 4e-4], A = 1 -> loss -s
    # seq 1: log-ratio 1e-3 -> s = e^1e-3 > 1.0004, A = 2 -> min(2 s, 2 * 1.0004) = 2.0008 -> loss -2.0008
    # seq 2: log-ratios -1e-3 (both) -> s = e^-1e-3 < 0.9997, A = -1 -> min(-s, -0.9997) -> loss 0.9997
    logp=[-1.0, -2.0, -0.5, -1.0, -1.0],
    old=[-1.0003, -1.9999, -0.501, -0.999, -0.999],
    adv=[1.0, 2.0, -1.0],
    seq_ids=[0, 0, 1, 2, 2],
    lengths=[2, 1, 2],
)


def test_gspo_hand_computed_sequence_ratio_and_clip():
    s0 = math.exp(1e-4)
    loss, grad, m = _run("gspo", **GSPO)
    assert loss == pytest.approx((-s0 - 2.0008 + 0.9997) / 3, abs=1e-6)
    # only seq 0 is inside the clip range: d/dlogp_t of -(1/S) * A * exp(mean_t) = -(1/3) * s0 / 2 per token
    torch.testing.assert_close(grad, torch.tensor([-s0 / 6, -s0 / 6, 0.0, 0.0, 0.0]))
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3) and m["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    assert m["ratio_mean"].item() == pytest.approx((s0 + math.exp(1e-3) + math.exp(-1e-3)) / 3, abs=1e-6)
    # the same data under grpo's 0.2 clip range clips nothing: the difference is the defaults
    _, _, m_grpo = _run("grpo", **GSPO)
    assert m_grpo["clip_frac"].item() == 0.0


def test_gspo_is_grpo_with_other_defaults():
    """GSPO's sequence-level objective is the grpo kind's: with the same clip range, bit-identical."""
    a = _run("gspo", **GSPO)
    b = _run("grpo", **GSPO, clip_low=3e-4, clip_high=4e-4)
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][k], b[2][k]) for k in a[2])
    n = LossNorm.for_step(LossConfig(kind="gspo"), [3, 0, 2])
    assert (n.denom.item(), n.unit_count.item()) == (2.0, 2.0)  # means over sequences, as grpo


def test_gspo_differs_from_token_level_clipping():
    # one sequence, log-ratios +0.5, -0.5: token-level ratios e^0.5 and e^-0.5 are both clipped under
    # token_grpo (A = 1: only the high side binds), the sequence ratio is exactly 1 under gspo
    kw = dict(logp=[-1.0, -1.0], old=[-1.5, -0.5], adv=[1.0], seq_ids=[0, 0], lengths=[2])
    loss, grad, m = _run("gspo", **kw, clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-1.0, abs=1e-6) and m["clip_frac"].item() == 0.0
    torch.testing.assert_close(grad, torch.tensor([-0.5, -0.5]))
    loss_t, _, m_t = _run("token_grpo", **kw)
    # t0: min(e^0.5, 1.2) = 1.2; t1: min(e^-0.5, e^-0.5) = e^-0.5 (unclipped on the pessimistic side)
    assert loss_t == pytest.approx(-(1.2 + math.exp(-0.5)) / 2, abs=1e-6)
    assert m_t["clip_frac"].item() == 1.0


# -- CISPO ------------------------------------------------------------------------------------------------------

CISPO = dict(
    # t0 seq0 A=1  r=e^0.1 (inside)          w = e^0.1   loss_t = -w * A * logp = -e^0.1 * 1 * -1.0 = e^0.1
    # t1 seq0 A=1  r=1.5 (above 1.28)        w = 1.28    loss_t = -1.28 * 1 * -2.0 = 2.56
    # t2 seq1 A=-2 r=0.5 (no floor)          w = 0.5     loss_t = -0.5 * -2 * -0.5 = -0.5
    # t3 seq1 A=-2 r=1                       w = 1       loss_t = -1 * -2 * -3.0 = -6
    logp=[-1.0, -2.0, -0.5, -3.0],
    old=[-1.1, -2.0 - LN15, -0.5 + LN2, -3.0],
    adv=[1.0, -2.0],
    seq_ids=[0, 0, 1, 1],
    lengths=[2, 2],
)


def test_cispo_hand_computed():
    cfg = LossConfig(kind="cispo")
    assert (cfg.floor, cfg.ceiling) == (1.0, 0.28)  # no lower bound on the IS weight; upper 1.28
    loss, grad, m = _run("cispo", **CISPO)
    assert loss == pytest.approx((E01 + 2.56 - 0.5 - 6.0) / 4, abs=1e-6)
    # d/dlogp_t = -w_t * A / N: every token keeps a gradient, the clipped t1 included (token_grpo zeroes it)
    torch.testing.assert_close(grad, torch.tensor([-E01 / 4, -1.28 / 4, 0.5 * 2 / 4, 2.0 / 4]))
    assert m["clip_frac_high"].item() == 0.25 and m["clip_frac_low"].item() == 0.0
    assert m["clip_frac"].item() == 0.25
    assert m["ratio_mean"].item() == pytest.approx((E01 + 1.5 + 0.5 + 1.0) / 4, abs=1e-6)
    assert m["pg_loss"].item() == pytest.approx(loss, abs=1e-7) and "kl" not in m
    _, grad_ppo, _ = _run("token_grpo", **CISPO)
    assert grad_ppo[1] == 0.0 and grad[1] != 0.0


def test_cispo_with_a_floor():
    # clip_low 0.2: t2's weight 0.5 -> 0.8: loss_t = -0.8 * -2 * -0.5 = -0.8, gradient 0.8 * 2 / 4
    loss, grad, m = _run("cispo", **CISPO, clip_low=0.2, clip_high=0.1)
    # and clip_high 0.1: t0's weight e^0.1 -> 1.1 and t1's -> 1.1
    assert loss == pytest.approx((1.1 + 2.2 - 0.8 - 6.0) / 4, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-1.1 / 4, -1.1 / 4, 0.8 * 2 / 4, 2.0 / 4]))
    assert m["clip_frac_low"].item() == 0.25 and m["clip_frac_high"].item() == 0.5


def test_cispo_padding_rows_are_ignored_even_when_not_finite():
    loss, grad, m = _run("cispo", [-1.0, float("-inf")], [-1.0, 0.0], [2.0], [0, 0], [1], token_mask=[1.0, 0.0])
    assert loss == pytest.approx(-1.0 * 2.0 * -1.0, abs=1e-7)  # w = 1, A = 2, logp = -1: loss 2
    torch.testing.assert_close(grad, torch.tensor([-2.0, 0.0]))
    assert m["ratio_mean"].item() == 1.0


def test_cispo_rejects_dual_clip():
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(kind="cispo", dual_clip=3.0)


# -- KL estimators ----------------------------------------------------------------------------------------------

# d = ref - logp per token: [ln 2, 0, -2 ln 2]
KL_LOGP = [-1.0, -1.0, -1.0]
KL_REF = [-1.0 + LN2, -1.0, -1.0 - 2 * LN2]
KL_TOK = {  # per token, by hand
    "k1": [-LN2, 0.0, 2 * LN2],  # -d
    "k2": [LN2 ** 2 / 2, 0.0, 2 * LN2 ** 2],  # d^2 / 2
    "k3": [1.0 - LN2, 0.0, 0.25 + 2 * LN2 - 1.0],  # e^d - d - 1
}
KL_GRAD = {  # d/dlogp per token, by hand
    "k1": [1.0, 1.0, 1.0],
    "k2": [-LN2, 0.0, 2 * LN2],  # -d
    "k3": [1.0 - 2.0, 0.0, 1.0 - 0.25],  # 1 - e^d
}


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_token_mean(est):
    # ratio 1 and zero advantages: only the KL is left; token_grpo reduces it over the step's 3 tokens
    loss, grad, m = _run("token_grpo", KL_LOGP, KL_LOGP, [0.0, 0.0], [0, 0, 1], [2, 1], ref=KL_REF, kl_coef=0.5,
                         kl_estimator=est)
    kl = sum(KL_TOK[est]) / 3
    assert m["kl"].item() == pytest.approx(kl, abs=1e-6)
    assert m["pg_loss"].item() == 0.0
    assert loss == pytest.approx(0.5 * kl, abs=1e-6)
    torch.testing.assert_close(grad, 0.5 / 3 * torch.tensor(KL_GRAD[est]))


@pytest.mark.parametrize("kind", ["grpo", "gspo"])
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_sequence_mean(kind, est):
    # per sequence mean, then mean over the 2 sequences: ((t0 + t1) / 2 + t2) / 2
    t = KL_TOK[est]
    _, _, m = _run(kind, KL_LOGP, KL_LOGP, [1.0, -1.0], [0, 0, 1], [2, 1], ref=KL_REF, kl_coef=0.1, kl_estimator=est)
    assert m["kl"].item() == pytest.approx(((t[0] + t[1]) / 2 + t[2]) / 2, abs=1e-6)


def test_kl_estimator_values_spelled_out():
    # the three, on d = ln 2, written as numbers: k1 = -0.693147, k2 = 0.240227, k3 = 2 - ln 2 - 1 = 0.306853
    for est, want in (("k1", -0.6931472), ("k2", 0.2402265), ("k3", 0.3068528)):
        _, _, m = _run("token_grpo", [-1.0], [-1.0], [0.0], [0], [1], ref=[-1.0 + LN2], kl_coef=1.0, kl_estimator=est)
        assert m["kl"].item() == pytest.approx(want, abs=1e-6), est


def test_cispo_kl_is_token_mean():
    loss, _, m = _run("cispo", KL_LOGP, KL_LOGP, [0.0, 0.0], [0, 0, 1], [2, 1], ref=KL_REF, kl_coef=0.5)
    assert m["kl"].item() == pytest.approx(sum(KL_TOK["k3"]) / 3, abs=1e-6)
    assert loss == pytest.approx(0.5 * sum(KL_TOK["k3"]) / 3, abs=1e-6)


@pytest.mark.parametrize("kind", ["grpo", "token_grpo", "gspo", "cispo"])
def test_kl_not_in_loss_is_a_metric_only(kind):
    kw = dict(logp=[-1.0, -2.0, -0.5], old=[-1.1, -1.9, -0.6], adv=[1.0, -0.5], seq_ids=[0, 0, 1],
              lengths=[2, 1], clip_low=0.2, clip_high=0.2)
    loss, grad, m = _run(kind, **kw, ref=[-1.0 + LN2, -2.0, -0.5 - LN2], kl_coef=0.5, kl_in_loss=False)
    loss0, grad0, m0 = _run(kind, **kw)
    assert loss == loss0 and torch.equal(grad, grad0)  # no penalty: the policy term alone
    assert m["pg_loss"].item() == m0["pg_loss"].item() and m["loss"].item() == m0["loss"].item()
    assert m["kl"].item() > 0  # but measured
    _, grad_in, m_in = _run(kind, **kw, ref=[-1.0 + LN2, -2.0, -0.5 - LN2], kl_coef=0.5)
    assert m_in["kl"].item() == m["kl"].item() and not torch.equal(grad_in, grad)


def test_kl_config_validation():
    with pytest.raises(ValueError, match="kl_estimator"):
        LossConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="kl_in_loss"):  # metric-only KL needs the reference kl_coef > 0 builds
        LossConfig(kl_in_loss=False)
    assert LossConfig().kl_estimator == "k3" and LossConfig().kl_in_loss is True


# -- zero advantage, gradient accumulation ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_zero_advantage_gives_zero_loss_and_grad(kind):
    loss, grad, _ = _run(kind, [-1.0, -2.0, -0.3], [-1.5, -1.0, -0.2], [0.0, 0.0], [0, 0, 1], [2, 1])
    assert loss == 0.0
    assert (grad == 0).all()


# -- advantages -------------------------------------------------------------------------------------------------

def test_rloo_hand_computed():
    adv = rloo_advantages([1.0, 0.0, 0.0, 0.0, 5.0, 3.0, 1.0, 3.0], group_size=4)
    # group 0: 1 - 0, 0 - 1/3 (x3); group 1: 5 - 7/3, 3 - 3, 1 - 11/3, 3 - 3
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 8 / 3, 0.0, -8 / 3, 0.0]))
    # [P, G] layout; G = 2: each is scored against the other
    torch.testing.assert_close(rloo_advantages(torch.tensor([[2.0, 5.0]]), 2), torch.tensor([[-3.0, 3.0]]))
    # equal groups are exactly 0 (0.1 * 3 / 3 != 0.1 in floating point)
    assert (rloo_advantages([0.1, 0.1, 0.1], 3) == 0).all()
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages([1.0, 2.0], 1)


def test_rloo_unscorable_follow_trl():
    """NaN (unscorable): advantage 0, and out of the others' leave-one-out means, as TRL 1.16's RLOOTrainer
    computes them (its formula, from rloo_trainer.py: nansum of the others over the scorable count - 1)."""
    nan = float("nan")
    r = torch.tensor([[1.0, nan, 0.0, 4.0], [nan, 2.0, nan, nan]])
    adv = rloo_advantages(r, 4)
    # group 0 as if the NaN were not there: 1 - 2, 0 - 2.5, 4 - 0.5; group 1: one scorable, no baseline: 0
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, -2.5, 3.5], [0.0, 0.0, 0.0, 0.0]]))
    count = (~r.isnan()).sum(dim=1, keepdim=True)
    trl = torch.nan_to_num(r - (torch.nansum(r, dim=1, keepdim=True) - r) / (count - 1), nan=0.0)
    torch.testing.assert_close(adv, trl)


def test_reinforce_pp_unscorable_left_out():
    nan = float("nan")
    for baseline in (False, True):
        adv = reinforce_pp_advantages([1.0, nan, 0.0, 3.0, nan, 1.0], 3, baseline=baseline, eps=0.0)
        without = reinforce_pp_advantages([1.0, 0.0, 3.0, 1.0], 2, baseline=baseline, eps=0.0)
        assert adv[1] == 0 and adv[4] == 0
        torch.testing.assert_close(adv[[0, 2, 3, 5]], without)


def test_reinforce_pp_hand_computed():
    # raw rewards, normalised over the batch: mean 2/3, centred [1/3, -2/3, -2/3, 1/3, 1/3, 1/3],
    # sample var (4 / 9 + 2 * 4 / 9) / 5 = 4 / 15
    want = torch.tensor([1 / 3, -2 / 3, -2 / 3, 1 / 3, 1 / 3, 1 / 3]) / math.sqrt(4 / 15)
    r = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    for gs in (1, 2, 3, 6):  # the grouping does not matter
        torch.testing.assert_close(reinforce_pp_advantages(r, gs, baseline=False, eps=0.0), want)
    torch.testing.assert_close(reinforce_pp_advantages(r, 1, baseline=False), want, atol=1e-5, rtol=0)  # eps 1e-6


def test_reinforce_pp_baseline_hand_computed():
    # group means 0.5 and 2: centred [0.5, -0.5, 1, -1], batch mean 0, sample var (0.25 * 2 + 1 * 2) / 3 = 5 / 6
    adv = reinforce_pp_advantages(torch.tensor([[1.0, 0.0], [3.0, 1.0]]), 2, baseline=True, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5], [1.0, -1.0]]) / math.sqrt(5 / 6))
    # unlike GRPO, whose per-group std makes both groups [0.707, -0.707]
    grpo = group_advantages(torch.tensor([[1.0, 0.0], [3.0, 1.0]]), 2, eps=0.0)
    torch.testing.assert_close(grpo, torch.tensor([[1.0, -1.0], [1.0, -1.0]]) / math.sqrt(2))


def test_reinforce_pp_no_signal_is_exactly_zero():
    assert (reinforce_pp_advantages([0.1, 0.1, 0.1, 0.1], 2, baseline=False) == 0).all()
    assert (reinforce_pp_advantages([3.0], 1, baseline=False) == 0).all()  # a batch of one
    assert (reinforce_pp_advantages([0.1, 0.1, 0.3, 0.3], 2, baseline=True) == 0).all()  # equal groups
    assert (reinforce_pp_advantages([1.0, 0.0, 2.0], 1, baseline=True) == 0).all()  # no group to compare with


def test_compute_advantages_dispatch():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 3.0, 1.0, 3.0])
    assert ADVANTAGE_KINDS == ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
    torch.testing.assert_close(compute_advantages(r, 4), group_advantages(r, 4))
    torch.testing.assert_close(compute_advantages(r, 4, normalize_std=False), group_advantages(r, 4, False))
    torch.testing.assert_close(compute_advantages(r, 4, "rloo"), rloo_advantages(r, 4))
    torch.testing.assert_close(compute_advantages(r, 4, "reinforce_pp"), reinforce_pp_advantages(r, 4, False))
    torch.testing.assert_close(compute_advantages(r, 4, "reinforce_pp_baseline"),
                               reinforce_pp_advantages(r, 4, True))
    with pytest.raises(ValueError, match="advantage kind"):
        compute_advantages(r, 4, "ppo")


def _group(rewards):
    return [Rollout(None, [1], [2], [0.0], "stop", "", {"r": x}) for x in rewards]


def test_assign_advantages_kinds():
    groups = [_group([1.0, 0.0, 0.0, 0.0]), _group([5.0, 3.0, 1.0, 3.0])]
    assign_advantages(groups, normalize_std=True, kind="rloo")
    got = [r.advantage for g in groups for r in g]
    assert got == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, 8 / 3, 0.0, -8 / 3, 0.0], abs=1e-6)
    assign_advantages(groups, normalize_std=False)  # default kind grpo, mean only (Dr. GRPO)
    assert [r.advantage for r in groups[1]] == pytest.approx([2.0, 0.0, -2.0, 0.0])
    singles = [_group([1.0]), _group([0.0])]  # group_size 1: REINFORCE++ needs no group
    assign_advantages(singles, normalize_std=True, kind="reinforce_pp")
    # centred [0.5, -0.5], sample std sqrt(0.5)
    assert [g[0].advantage for g in singles] == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)],
                                                               abs=1e-5)


# -- config -----------------------------------------------------------------------------------------------------

def test_advantage_config_key_and_group_size_rule():
    assert RolloutSection().advantage == "grpo"
    with pytest.raises(ValueError, match="rollout.advantage must be one of"):
        RolloutSection(advantage="gae")
    RunConfig(rollout=RolloutSection(group_size=1, advantage="reinforce_pp"))  # needs no group
    for kind in ("grpo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(ValueError, match="group_size must be >= 2") as e:
            RunConfig(rollout=RolloutSection(group_size=1, advantage=kind))
        assert "\n" not in str(e.value)
    cfg = run_config("tiny", {"rollout.advantage": "reinforce_pp", "rollout.group_size": "1",
                              "trainer.loss.kind": "cispo", "trainer.loss.kl_estimator": "k2",
                              "trainer.loss.kl_coef": "0.1", "trainer.loss.kl_in_loss": "false"})
    assert (cfg.rollout.advantage, cfg.rollout.group_size, cfg.trainer.loss.kind) == ("reinforce_pp", 1, "cispo")
    assert (cfg.trainer.loss.kl_estimator, cfg.trainer.loss.kl_in_loss) == ("k2", False)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        run_config("tiny", {"rollout.advantage": "rloo", "rollout.group_size": "1"})
    # the presets keep their advantage (qwen3_0_6b_sum_digits: mean-only group advantages)
    ref = preset("qwen3_0_6b_sum_digits")
    assert (ref.rollout.advantage, ref.rollout.advantage_std_norm) == ("grpo", False)


# -- through the trainer and the loop ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gspo", "cispo"])
def test_trainer_accumulation_is_exact(kind):
    from monorl.model.config import model_shape
    from monorl.model.decoder import build_model
    from monorl.train.trainer import Trainer, TrainerConfig
    from tests.test_trainer import _seqs

    results = []
    for budget in (32, 4096):  # many micro-batches vs one
        model = build_model(model_shape("tiny"), seed=3)
        before = [p.detach().clone() for p in model.parameters()]
        tr = Trainer(model, TrainerConfig(lr=1e-3, micro_batch_tokens=budget, warmup_steps=1,
                                          loss=LossConfig(kind=kind)), total_steps=4)
        m = tr.step(_seqs())
        assert m["skipped"] == 0.0 and {"clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean"} <= set(m)
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        results.append(m)
    assert results[0]["micro_batches"] > 1 and results[1]["micro_batches"] == 1
    assert math.isclose(results[0]["loss"], results[1]["loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(results[0]["grad_norm"], results[1]["grad_norm"], rel_tol=1e-4)


def test_loop_passes_the_advantage_kind_and_keeps_dr_grpos_rule(tmp_path, monkeypatch):
    import monorl.rl.consumer as consumer
    import monorl.run.grpo as loop
    from tests.conftest import digits_cfg

    calls = []
    real = consumer.assign_advantages

    def spy(groups, normalize_std, kind="grpo"):
        calls.append((normalize_std, kind))
        real(groups, normalize_std, kind)

    monkeypatch.setattr(consumer, "assign_advantages", spy)
    for adv, loss, want in (("grpo", "dr_grpo", (False, "grpo")), ("grpo", "gspo", (True, "grpo")),
                            ("rloo", "cispo", (True, "rloo"))):
        cfg = digits_cfg(tmp_path / f"{adv}-{loss}", steps=1)
        cfg.rollout.prompts_per_step, cfg.rollout.max_new_tokens = 2, 4
        cfg.rollout.advantage, cfg.trainer.loss.kind = adv, loss
        row = loop.GRPORun(cfg, progress=False).step(0)
        assert calls[-1] == want and math.isfinite(row["loss"])


def test_loop_reinforce_pp_with_single_completions(tmp_path):
    from monorl.run.grpo import GRPORun
    from tests.conftest import digits_cfg

    cfg = digits_cfg(tmp_path, steps=1)
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 4, 1, 4
    cfg.rollout.advantage = "reinforce_pp"
    cfg.trainer.loss.kind, cfg.trainer.loss.kl_coef, cfg.trainer.loss.kl_in_loss = "cispo", 0.1, False
    cfg.trainer.loss.kl_estimator = "k2"
    run = GRPORun(cfg, progress=False)
    row = run.step(0)
    assert math.isfinite(row["loss"]) and row["skipped"] == 0.0 and "kl" in row


def test_kl_term_under_compiled_trainer_blocks(tmp_path):
    """A compiled trainer warms up on packs that carry reference log-probs when the loss has a KL term (its
    warm-up packs had none: `kl_coef > 0 needs ref_logprobs` before the first step)."""
    from monorl.run.grpo import GRPORun
    from tests.test_resume import small_cfg

    cfg = small_cfg(tmp_path / "run", **{"trainer.loss.kl_coef": "0.1", "compile.backend": "eager", "steps": "1",
                                         "warm_start.steps": "0", "checkpoint.final": "false"})
    result = GRPORun(cfg, progress=False).run()
    assert result.steps[0]["kl"] == 0.0  # the policy is its own reference at the first step
