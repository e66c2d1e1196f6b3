import math

import pytest
import torch

from monorl.rl.advantages import group_advantages


def test_sample_std_hand_computed():
    # mean 0.25, centred [.75, -.25, -.25, -.25], sample var = (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], group_size=4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # population std would be sqrt(0.1875) = 0.433 -> 1.732: this pins the choice of the sample std
    assert not math.isclose(adv[0].item(), 0.75 / math.sqrt(0.1875), rel_tol=1e-3)


def test_two_groups_flat_and_2d():
    rewards = [2.0, 4.0, 1.0, 0.0, 0.0, 0.0]  # group_size 3 would not fit the first layout; use 2 and 3
    adv = group_advantages(rewards[:2], group_size=2, eps=0.0)
    # centred [-1, 1], sample std sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2)]))
    r2 = torch.tensor([[1.0, 0.0, 0.0], [3.0, 3.0, 0.0]])
    adv2 = group_advantages(r2, group_size=3, eps=0.0)
    assert adv2.shape == (2, 3)
    # group 0: mean 1/3, centred [2/3, -1/3, -1/3], var (4/9 + 1/9 + 1/9) / 2 = 1/3
    s0 = math.sqrt(1 / 3)
    # group 1: mean 2, centred [1, 1, -2], var (1 + 1 + 4) / 2 = 3
    s1 = math.sqrt(3)
    torch.testing.assert_close(adv2, torch.tensor([[2 / 3 / s0, -1 / 3 / s0, -1 / 3 / s0], [1 / s1, 1 / s1, -2 / s1]]))
    torch.testing.assert_close(group_advantages(r2.reshape(-1), 3, eps=0.0), adv2.reshape(-1))


def test_eps_is_added_to_std():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], group_size=4, eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))  # std 0.5 + eps 0.5 = 1


def test_dr_grpo_mean_only():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0, 5.0, 3.0, 1.0, 3.0], group_size=4, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 2.0, 0.0, -2.0, 0.0]))


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_all_equal_groups_are_exactly_zero(normalize_std, eps):
    # 0.1 * 3 / 3 != 0.1 in floating point: without care this gives tiny / tiny advantages
    adv = group_advantages([0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 1.0, 0.0, 1.0], 3, normalize_std=normalize_std, eps=eps)
    assert torch.isfinite(adv).all()
    assert (adv[:6] == 0).all()
    assert adv[6] > 0 and adv[7] < 0


def test_group_size_one_is_zero():
    assert (group_advantages([1.0, 5.0, -2.0], 1) == 0).all()


def test_errors():
    with pytest.raises(ValueError, match="group"):
        group_advantages([1.0, 2.0, 3.0], 2)
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1.0], 0)
    with pytest.raises(ValueError, match="inf"):
        group_advantages([1.0, float("inf")], 2)


NAN = float("nan")


def _trl_grpo(rewards: torch.Tensor, group_size: int, scale: bool) -> torch.Tensor:
    """TRL 1.16's GRPO advantage (GRPOTrainer._generate_and_score_completions, "sum_then_normalize", scale_rewards
    "group" / "none"), step by step from its source, with TRL's own nanstd: NaN marks an unscorable completion."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, group_size), dim=1).repeat_interleave(group_size, dim=0)
    std = nanstd(rewards.view(-1, group_size), dim=1).repeat_interleave(group_size, dim=0)
    adv = rewards - mean
    if scale:
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_unscorable_completions_follow_trl(normalize_std):
    """A completion no reward applied to (NaN) gets advantage exactly 0 and is left out of its group's mean and
    std: the others' advantages are those of their group without it, and equal TRL 1.16's computation."""
    pytest.importorskip("trl")
    rewards = torch.tensor([1.0, NAN, 0.0, 0.5,   # one unscorable
                            NAN, NAN, NAN, NAN,   # none scorable
                            NAN, 2.0, NAN, NAN,   # one scorable: no signal
                            0.0, 3.0, 1.0, 2.0])  # all scorable
    adv = group_advantages(rewards, 4, normalize_std=normalize_std, eps=1e-4)
    assert (adv[rewards.isnan()] == 0).all() and (adv[4:12] == 0).all()
    without = group_advantages([1.0, 0.0, 0.5], 3, normalize_std=normalize_std, eps=1e-4)
    torch.testing.assert_close(adv[[0, 2, 3]], without)
    torch.testing.assert_close(adv, _trl_grpo(rewards, 4, normalize_std))
    # what monorl did before: unscorable as reward 0, inside the baseline -- a different, nonzero advantage
    assert group_advantages([1.0, 0.0, 0.0, 0.5], 4, normalize_std=normalize_std)[1] != 0
