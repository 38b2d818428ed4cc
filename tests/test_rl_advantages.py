import pytest
import torch

from archon.rl.advantages import (
    distillation_advantages,
    drgrpo_advantages,
    expand_to_tokens,
    group_mean_std,
    groups_with_reward_variance,
    grpo_advantages,
    mixed_distillation_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_lengths,
)

# Three groups of G=4: one correct of four, all equal, a spread.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 3.0, 1.0, 2.0, 2.0])


def test_grpo_advantages_unbiased_std():
    # group 1: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5; group 3: mean 2, std sqrt(2 / 3) = 0.8164966
    expected = [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 1.2247449, -1.2247449, 0.0, 0.0]
    adv = grpo_advantages(REWARDS, group_size=4, eps=1e-6)
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=0)


def test_grpo_advantages_biased_std():
    # group 1: population std sqrt(0.75 / 4) = 0.4330127
    adv = grpo_advantages(REWARDS[:4], group_size=4, eps=0.0, unbiased_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.7320508, -0.5773503, -0.5773503, -0.5773503]))


def test_grpo_all_equal_rewards_give_zero_not_nan():
    adv = grpo_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]), group_size=3)
    assert torch.equal(adv, torch.zeros(6))


def test_group_of_one_has_zero_std_and_advantage():
    mean, std = group_mean_std(torch.tensor([0.3, 0.9]), group_size=1)
    torch.testing.assert_close(mean, torch.tensor([0.3, 0.9]).double())
    assert torch.equal(std, torch.zeros(2, dtype=torch.float64))
    assert torch.equal(grpo_advantages(torch.tensor([0.3, 0.9]), group_size=1), torch.zeros(2))


def test_rewards_not_divisible_by_group_size():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(torch.ones(5), group_size=2)


def test_drgrpo_advantages_have_no_std():
    expected = [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0]
    torch.testing.assert_close(drgrpo_advantages(REWARDS, group_size=4), torch.tensor(expected))


def test_dynamic_sampling_keeps_groups_with_mixed_rewards():
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1.0])
    keep = groups_with_reward_variance(rewards, group_size=4)
    assert keep.tolist() == [True, False, False, True]
    assert keep.repeat_interleave(4).sum().item() == 8
    assert groups_with_reward_variance(REWARDS, group_size=4).tolist() == [True, False, True]


def test_overlong_penalty():
    lengths = torch.tensor([0, 15, 16, 18, 20, 25])
    # L=20, buffer 5: no penalty up to 15 tokens, then -(|y| - 15) / 5, and -1 past 20
    torch.testing.assert_close(
        overlong_penalty(lengths, max_response_length=20, buffer_length=5),
        torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0]),
    )
    torch.testing.assert_close(
        overlong_penalty(lengths, max_response_length=20, buffer_length=5, penalty_factor=0.5),
        torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5, -0.5]),
    )
    with pytest.raises(ValueError):
        overlong_penalty(lengths, max_response_length=20, buffer_length=0)


def test_distillation_advantages_are_reverse_kl_and_detached():
    student = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    teacher = torch.tensor([-1.5, -1.0, -0.5])
    adv = distillation_advantages(student, teacher)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 1.0, 0.0]))
    assert not adv.requires_grad


def test_expand_to_tokens_with_an_empty_sequence():
    cu_seqlens = torch.tensor([0, 2, 2, 5])
    assert sequence_lengths(cu_seqlens).tolist() == [2, 0, 3]
    expanded = expand_to_tokens(torch.tensor([0.5, -1.0, 2.0]), cu_seqlens)
    assert expanded.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError):
        expand_to_tokens(torch.tensor([1.0, 2.0]), cu_seqlens)


def test_huge_finite_rewards_give_finite_advantages():
    """Rewards up to the float32 limit: in float32 the squares (and a sum of opposite extremes)
    overflow to inf and the advantages become NaN; the estimators compute in float64."""
    big = torch.finfo(torch.float32).max
    rewards = torch.tensor([1e38, 0.0, 0.0, 0.0, big, -big, big, -big, 1e38, 1e38, 1e38, 1e38])
    adv = grpo_advantages(rewards, group_size=4)
    assert adv.dtype == torch.float32 and bool(torch.isfinite(adv).all()), adv
    # Scale-free: the same as for the rewards divided by 1e38 (group 1 is [1, 0, 0, 0]).
    torch.testing.assert_close(adv[:4], grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv[4:8], torch.tensor([0.8660254, -0.8660254] * 2), atol=1e-5, rtol=0)
    assert torch.equal(adv[8:], torch.zeros(4))
    dr = drgrpo_advantages(rewards, group_size=4)
    assert dr.dtype == torch.float32 and bool(torch.isfinite(dr).all()), dr
    assert dr[0].item() == pytest.approx(7.5e37, rel=1e-6) and dr[4].item() == pytest.approx(big, rel=1e-6)


def test_rloo_leave_one_out_baseline():
    # group 1 [1, 0, 0, 0]: 1 - 0 = 1, 0 - 1/3 for the others; group 2 all equal: 0;
    # group 3 [3, 1, 2, 2]: 3 - 5/3 = 4/3, 1 - 7/3 = -4/3, 2 - 2 = 0, 0
    expected = [1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, 0.0, 4 / 3, -4 / 3, 0.0, 0.0]
    torch.testing.assert_close(rloo_advantages(REWARDS, group_size=4), torch.tensor(expected))
    # G / (G - 1) times the Dr.GRPO advantage
    torch.testing.assert_close(rloo_advantages(REWARDS, 4), drgrpo_advantages(REWARDS, 4) * 4 / 3)
    with pytest.raises(ValueError, match="at least 2 samples"):
        rloo_advantages(REWARDS, group_size=1)


def test_reinforce_pp_response_level_whitening():
    """Each response counted once (weights 1)."""
    rewards, once = torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.ones(4)
    # no group baseline: mean 1.75, unbiased std sqrt((0.5625 + 3.0625 + 1.5625 + 1.5625) / 3) = 1.5
    adv = reinforce_pp_advantages(rewards, group_size=2, group_baseline=False, weights=once, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-0.5, -1.75 / 1.5, 1.25 / 1.5, 1.25 / 1.5]))
    # REINFORCE++-baseline: group means 0.5 and 3 subtracted first: 0.5, -0.5, 0, 0; mean 0,
    # std sqrt(0.5 / 3) = 0.4082483
    adv = reinforce_pp_advantages(rewards, group_size=2, group_baseline=True, weights=once, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.2247449, -1.2247449, 0.0, 0.0]))
    assert torch.equal(reinforce_pp_advantages(torch.ones(4), 2, group_baseline=False, weights=once), torch.zeros(4))


def test_reinforce_pp_token_level_whitening():
    """Two responses of 1 and 3 loss tokens, rewards 1 and 0: the tokens' returns are 1, 0, 0, 0.
    Mean 1/4, unbiased std over the 4 tokens sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5, so the
    advantages are (1 - 0.25) / 0.5 = 1.5 and (0 - 0.25) / 0.5 = -0.5. Over responses (mean 0.5,
    std sqrt(0.5)) they would be +-0.7071068."""
    rewards, tokens = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 3.0])
    adv = reinforce_pp_advantages(rewards, group_size=1, group_baseline=False, weights=tokens, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5]))
    # a response without loss tokens (and a dropped one, weight 0) neither counts nor gets an advantage
    adv = reinforce_pp_advantages(
        torch.tensor([1.0, 7.0, 0.0]), 1, group_baseline=False, weights=torch.tensor([1.0, 0.0, 3.0]), eps=0.0
    )
    torch.testing.assert_close(adv, torch.tensor([1.5, 0.0, -0.5]))
    assert torch.equal(
        reinforce_pp_advantages(rewards, 1, group_baseline=False, weights=torch.zeros(2)), torch.zeros(2)
    )
    # REINFORCE++-baseline, G = 2, rewards [1, 0 | 2, 2] with 1, 3, 2, 2 tokens: x = 0.5, -0.5, 0, 0;
    # token mean (0.5 - 1.5) / 8 = -0.125; squares sum 0.25 + 0.75 = 1, so the unbiased variance is
    # (1 - 8 * 0.015625) / 7 = 0.125, std 0.3535534: (0.5 + 0.125) / std = 1.7677670,
    # (-0.5 + 0.125) / std = -1.0606602, 0.125 / std = 0.3535534
    adv = reinforce_pp_advantages(
        torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, group_baseline=True, weights=torch.tensor([1.0, 3.0, 2.0, 2.0]), eps=0.0
    )
    torch.testing.assert_close(adv, torch.tensor([1.7677670, -1.0606602, 0.3535534, 0.3535534]))


def test_reinforce_pp_baseline_with_groups_of_one_whitens_the_rewards():
    """No group mean to subtract from a group of one: the rewards themselves are whitened, as
    REINFORCE++ without a baseline does (a group mean would make every advantage 0)."""
    rewards, tokens = torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.tensor([2.0, 1.0, 1.0, 3.0])
    adv = reinforce_pp_advantages(rewards, 1, group_baseline=True, weights=tokens, eps=0.0)
    torch.testing.assert_close(adv, reinforce_pp_advantages(rewards, 1, group_baseline=False, weights=tokens, eps=0.0))
    # token returns 1, 1, 0, 3, 3, 3, 3: mean 2, squared deviations 1, 1, 4, 1, 1, 1, 1 = 10, std sqrt(10 / 6)
    std = (10 / 6) ** 0.5
    torch.testing.assert_close(adv, torch.tensor([-1 / std, -2 / std, 1 / std, 1 / std]))


def test_reinforce_pp_statistics_cover_every_rank():
    """Rank 0 holds rewards [1, 0], rank 1 [3, 3], with 1, 3, 2, 4 loss tokens: with batch_sum adding
    rank 1's totals (tokens, token-weighted sum and sum of squares), rank 0 gets its share of the
    whole-batch whitening."""
    whole, tokens = torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.tensor([1.0, 3.0, 2.0, 4.0])
    for baseline in (False, True):
        mine, theirs = whole[:2], whole[2:]
        x = theirs.double() - (theirs.double().mean() if baseline else 0.0)
        w = tokens[2:].double()
        other = torch.stack([w.sum(), (w * x).sum(), (w * x.square()).sum()])
        adv = reinforce_pp_advantages(
            mine, 2, group_baseline=baseline, weights=tokens[:2], batch_sum=lambda t: t + other
        )
        full = reinforce_pp_advantages(whole, 2, group_baseline=baseline, weights=tokens)
        torch.testing.assert_close(adv, full[:2])
        assert not torch.allclose(adv, reinforce_pp_advantages(mine, 2, group_baseline=baseline, weights=tokens[:2]))
    # no baseline, by hand: token returns 1, 0, 0, 0, 3, 3, 3, 3, 3, 3: mean 1.9, squares sum 55,
    # variance (55 - 10 * 3.61) / 9 = 2.1, std 1.4491377
    adv = reinforce_pp_advantages(whole, 2, group_baseline=False, weights=tokens, eps=0.0)
    torch.testing.assert_close(adv, (whole - 1.9) / 2.1**0.5)
    with pytest.raises(ValueError, match="weights has shape"):
        reinforce_pp_advantages(whole, 2, group_baseline=False, weights=tokens[:3])


def test_mixed_distillation_advantages():
    task = torch.tensor([0.5, 0.5, 0.5, -1.0, -1.0])
    student = torch.tensor([-1.0, -2.0, -0.5, -1.0, -1.0], requires_grad=True)
    teacher = torch.tensor([-1.5, -1.0, -0.5, -2.0, 0.0])
    # teacher - student = -0.5, 1, 0, -1, 1; task + 0.5 * that
    adv = mixed_distillation_advantages(task, student, teacher, weight=0.5)
    torch.testing.assert_close(adv, torch.tensor([0.25, 1.0, 0.5, -1.5, -0.5]))
    assert not adv.requires_grad
    with pytest.raises(ValueError, match="shape mismatch"):
        mixed_distillation_advantages(task[:3], student, teacher, weight=0.5)
