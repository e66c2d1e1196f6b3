"""The per-step metrics (TRL's names) and validation's pass@k / mean@k, against hand-computed values."""

import math

import pytest
import torch

from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.model.logprobs import chunked_token_logprobs, chunked_token_logprobs_entropy, token_entropy
from monorl.rl.rollouts.metrics import completion_metrics, reward_metrics, summarize
from monorl.rl.rollouts.rollout import Rollout
from monorl.run.summary import step_line, step_metrics
from monorl.train.losses import LossConfig, LossNorm, policy_loss
from monorl.train.packing import TrainSequence, make_micro_batches
from monorl.train.trainer import Trainer, TrainerConfig


def _r(rewards, n_tokens=1, finish="stop", weights=None):
    return Rollout(None, [1, 2], [3] * n_tokens, [0.0] * n_tokens, finish, "", rewards, weights=weights or {})


def test_unscorable_rollouts_get_zero_advantage_and_stay_out_of_the_stats():
    """TRL 1.16's rule through the rollouts: a completion every component returned None for (reward 0.0 by the sum)
    gets advantage exactly 0, the others' advantages are their group's without it, and the reward metrics leave it
    out (as TRL's reward / frac_reward_zero_std do)."""
    from monorl.rl.advantages import group_advantages
    from monorl.rl.rollouts.rollout import assign_advantages

    none = {"a": None, "b": None}
    g0 = [_r({"a": 1.0, "b": None}), _r(none), _r({"a": 0.0, "b": 0.5}), _r({"a": 0.0, "b": None})]
    g1 = [_r(none), _r({"a": 1.0, "b": None}), _r(none), _r(none)]  # one scorable: no signal
    assert [r.scorable for r in g0] == [True, False, True, True]
    assign_advantages([g0, g1], normalize_std=True)
    assert g0[1].advantage == 0.0 and all(r.advantage == 0.0 for r in g1)
    want = group_advantages([1.0, 0.5, 0.0], 3).tolist()
    assert [g0[i].advantage for i in (0, 2, 3)] == pytest.approx(want)
    m = reward_metrics([g0, g1], ("a", "b"))
    assert m["reward"] == pytest.approx((1.0 + 0.5 + 0.0 + 1.0) / 4)  # the 4 scorable of 8
    assert m["frac_reward_zero_std"] == 0.5  # g1 has no signal
    assert math.isnan(reward_metrics([[_r(none)] * 2], ("a", "b"))["reward"])  # none scorable: NaN, as TRL
    assert summarize([g0, g1], ("a", "b")).mean_reward == m["reward"]


def test_reward_and_completion_metrics_by_hand():
    w = {"a": 1.0, "b": 0.5}
    # rewards: 1 + (n/a), 0 + 0.5 * 2 = 1  -> zero std | 1 + 0.5 * 0 = 1, 0 + (n/a) = 0
    groups = [[_r({"a": 1.0, "b": None}, 3, "stop", w), _r({"a": 0.0, "b": 2.0}, 5, "length", w)],
              [_r({"a": 1.0, "b": 0.0}, 2, "stop", w), _r({"a": 0.0, "b": None}, 5, "length", w)]]
    m = reward_metrics(groups, ("a", "b"))
    assert m["reward"] == 0.75
    assert m["reward_std"] == pytest.approx((0.0 + math.sqrt(0.5)) / 2)  # mean of the groups' sample stds
    assert m["frac_reward_zero_std"] == 0.5
    # each component as returned (unweighted), over the completions it applies to
    assert m["rewards/a/mean"] == 0.5 and m["rewards/a/std"] == pytest.approx(math.sqrt(1 / 3))
    assert m["rewards/b/mean"] == 1.0 and m["rewards/b/std"] == pytest.approx(math.sqrt(2))
    assert reward_metrics([[_r({"a": None})] * 2], ("a",))["rewards/a/mean"] is None  # applies to none
    c = completion_metrics([r for g in groups for r in g])
    assert c == {"completions/mean_length": 3.75, "completions/min_length": 2.0, "completions/max_length": 5.0,
                 "completions/mean_terminated_length": 2.5, "completions/min_terminated_length": 2.0,
                 "completions/max_terminated_length": 3.0, "completions/clipped_ratio": 0.5}
    assert completion_metrics([_r({}, 4, "length")])["completions/mean_terminated_length"] == 0.0  # as TRL
    train = {"loss": 0.1, "entropy": 1.5, "learning_rate": 1e-3, "logprob_diff_mean": 0.0, "logprob_diff_max": 0.0}
    times = {"generate_s": 2.0, "train_s": 1.0, "sync_s": 1.0, "step_s": 4.0}
    row = step_metrics(3, groups, ("a", "b"), train, times, extra={"num_tokens": 99, "frac_reward_zero_std": 0.25})
    assert row["frac_reward_zero_std"] == 0.25 and row["num_tokens"] == 99  # the loop's values win
    assert row["throughput/tokens_per_s"] == (15 + 8) / 4.0 and row["throughput/generate_tokens_per_s"] == 15 / 2.0
    assert "a=+0.500, b=+1.000" in step_line(row, 10) and "entropy 1.500" in step_line(row, 10)


def test_pass_at_k_and_mean_at_k_by_hand():
    groups = [[_r({"acc": 1.0, "fmt": 1.0}), _r({"acc": 0.0, "fmt": 0.0}), _r({"acc": 0.0, "fmt": 1.0})],
              [_r({"acc": 0.0, "fmt": 1.0}), _r({"acc": 0.5, "fmt": 1.0}), _r({"acc": 0.0, "fmt": 0.0})],
              [_r({"acc": 1.0, "fmt": 1.0}), _r({"acc": 1.0, "fmt": 1.0}), _r({"acc": None, "fmt": 0.0})]]
    v = summarize(groups, ("acc", "fmt"), pass_component="acc", pass_threshold=1.0)
    assert (v.k, v.pass_at_k, v.mean_at_k) == (3, 2 / 3, 3 / 9)  # prompts 1 and 3 pass; 3 of 9 completions
    assert v.components == {"acc": pytest.approx(3.5 / 8), "fmt": 6 / 9}  # acc: None left out
    assert v.metrics()["val/pass@3"] == 2 / 3 and v.metrics()["val/mean@3"] == 1 / 3
    assert "pass@3=0.667 mean@3=0.333" in v.line()
    lenient = summarize(groups, ("acc", "fmt"), pass_component="acc", pass_threshold=0.5)
    assert (lenient.pass_at_k, lenient.mean_at_k) == (1.0, 4 / 9)
    greedy = summarize([[g[0]] for g in groups], ("acc", "fmt"), pass_component="acc")
    assert greedy.k == 1 and greedy.pass_at_k == greedy.mean_at_k == 2 / 3  # k = 1: pass@1 is the accuracy


def test_clip_ratio_counts_active_clips_as_trl():
    """clip_frac_*: ratio outside the range whatever the advantage; clip_ratio/*: only where the clip is active
    (below the floor with A < 0, above the ceiling with A > 0), TRL's definition."""
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0])
    old = torch.zeros(5)
    seq_ids = torch.arange(5)
    for kind in ("token_grpo", "grpo"):  # one token per sequence: the sequence ratio is the token's
        cfg = LossConfig(kind=kind)
        norm = LossNorm.for_step(cfg, [1] * 5)
        _, m = policy_loss(ratios.log(), old, adv, seq_ids, cfg, norm)
        assert m["clip_frac_high"].item() == pytest.approx(2 / 5) and m["clip_frac_low"].item() == pytest.approx(2 / 5)
        assert m["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)
        assert m["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)
        assert m["clip_ratio/region_mean"].item() == pytest.approx(2 / 5)


def test_entropy_from_the_logprob_chunks():
    torch.manual_seed(0)
    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    hidden = torch.randn(7, model.config.hidden_size, requires_grad=True)
    tokens = torch.randint(0, model.config.vocab_size, (7,))
    lp, ent = chunked_token_logprobs_entropy(model, hidden, tokens, temperature=0.7, chunk_size=3)
    logp = torch.log_softmax(model.compute_logits(hidden).float() / 0.7, dim=-1)
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1))
    torch.testing.assert_close(token_entropy(model.compute_logits(hidden), 0.7, block=2), ent)  # blocks of rows
    assert not ent.requires_grad
    lp2 = chunked_token_logprobs(model, hidden, tokens, temperature=0.7, chunk_size=3)
    torch.testing.assert_close(lp, lp2, rtol=0, atol=0)
    g1, = torch.autograd.grad(lp.sum(), hidden)  # checkpoint's recompute skips the entropy; gradients agree
    g2, = torch.autograd.grad(lp2.sum(), hidden)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)


def test_trainer_step_reports_token_mean_entropy():
    model = build_model(model_shape("tiny"), "cpu", torch.float32, seed=0)
    seqs = [TrainSequence([1, 2, 3], [4, 5], [0.0, 0.0], 1.0), TrainSequence([6, 7], [8, 9, 10], [0.0] * 3, -1.0)]
    (mb,) = make_micro_batches(seqs, 4096, "cpu")
    with torch.no_grad():
        hidden = model(mb.input_ids, mb.ctx.positions, mb.ctx)[mb.logit_index]
        logp = torch.log_softmax(model.compute_logits(hidden).float() / 0.9, dim=-1)
        expected = (-(logp.exp() * logp).sum(-1)).mean().item()  # over the 5 completion tokens
    m = Trainer(model, TrainerConfig(lr=1e-3), total_steps=2).step(seqs, temperature=0.9)
    assert m["entropy"] == pytest.approx(expected, rel=1e-5)
    assert {"learning_rate", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"} <= set(m)
