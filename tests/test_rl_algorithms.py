"""The algorithm registry: each name builds an Algorithm whose prepare (rewards -> advantages and
batch filters), token advantages (distillation) and loss are the pure functions of
archon.rl.advantages and archon.rl.losses, put together as the algorithm defines."""

import math
import typing
from pathlib import Path

import pytest
import torch

from archon.batch import PackedBatch
from archon.rl.advantages import (
    distillation_advantages,
    drgrpo_advantages,
    groups_with_reward_variance,
    grpo_advantages,
    overlong_penalty,
    rloo_advantages,
)
from archon.rl.algorithms import ALGORITHMS, AlgorithmName, LossConfig, get_algorithm, group_size_problem
from archon.rl.config import AlgorithmConfig, load_config_file
from archon.rl.losses import ppo_clip_token_losses
from archon.trainer import LossContext

REPO = Path(__file__).resolve().parents[1]
G = 4
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 3.0, 1.0, 2.0, 2.0])
LENGTHS = torch.tensor([3.0, 9.0, 10.0, 12.0, 1.0, 2.0, 3.0, 4.0, 8.0, 6.0, 7.0, 5.0])


def build(name="grpo", max_new_tokens=10, **settings):
    loss = {k: v for k, v in settings.items() if k in LossConfig.__dataclass_fields__}
    rest = {k: v for k, v in settings.items() if k not in loss}
    return get_algorithm(AlgorithmConfig(name=name, loss=LossConfig(**loss), **rest), max_new_tokens)


def tiny_batch(advantages: torch.Tensor, seed: int = 0) -> PackedBatch:
    """One packed sequence per sample, prompt of 2 tokens and 1-4 response tokens, with old,
    rollout and reference log-probs near the policy's."""
    g = torch.Generator().manual_seed(seed)
    sequences = [list(range(2 + 1 + i % 4)) for i in range(advantages.numel())]
    batch = PackedBatch.from_sequences(sequences, prompt_lens=[2] * len(sequences), advantages=advantages.tolist())
    T = batch.num_tokens
    batch.old_logprobs = -torch.rand(T, generator=g) * 2
    batch.rollout_logprobs = batch.old_logprobs + 0.2 * torch.randn(T, generator=g)
    batch.ref_logprobs = batch.old_logprobs + 0.2 * torch.randn(T, generator=g)
    return batch


def test_the_config_type_lists_the_registry():
    assert typing.get_args(AlgorithmName) == tuple(ALGORITHMS)
    assert typing.get_type_hints(AlgorithmConfig)["name"] == AlgorithmName


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_prepares_and_trains(name):
    algorithm = build(name)
    assert algorithm.name == name
    prepared = algorithm.prepare(REWARDS, LENGTHS, G)
    assert prepared.advantages.dtype == torch.float32 and prepared.advantages.shape == REWARDS.shape
    assert bool(torch.isfinite(prepared.advantages).all()) and bool(prepared.keep.all())
    batch = tiny_batch(prepared.advantages)
    logprobs = (batch.old_logprobs + 0.1).requires_grad_()
    entropy = torch.rand(batch.num_tokens, requires_grad=True)
    ctx = LossContext.for_batch(batch.loss_mask, batch.cu_seqlens, entropy=entropy)
    loss, metrics = algorithm.loss(batch, logprobs, ctx)
    loss.backward()
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(logprobs.grad).all())
    assert logprobs.grad[batch.loss_mask].abs().sum() > 0
    assert all(bool(torch.isfinite(v)) for v in metrics.values())

    # and with every optional term on (dual clip where the objective is PPO's)
    extras = dict(kl_coef=0.1, kl_cap=5.0, entropy_coef=0.01, importance_sampling="token", icepop_band=(0.5, 2.0))
    if ALGORITHMS[name].objective is ppo_clip_token_losses:
        extras["clip_ratio_c"] = 3.0
    algorithm = build(name, overlong_buffer=4, dynamic_sampling=True, **extras)
    prepared = algorithm.prepare(REWARDS, LENGTHS, G)
    batch = tiny_batch(prepared.advantages[prepared.keep])
    logprobs = (batch.old_logprobs + 0.1).requires_grad_()
    entropy = torch.rand(batch.num_tokens, requires_grad=True)
    ctx = LossContext.for_batch(batch.loss_mask, batch.cu_seqlens, entropy=entropy)
    loss, metrics = algorithm.loss(batch, logprobs, ctx)
    loss.backward()
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(logprobs.grad).all()) and entropy.grad is not None
    for key in ("kl", "entropy_bonus", "tis_weight_mean", "icepop_masked_fraction"):
        assert key in metrics, key


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'; registered algorithms: grpo, drgrpo, dapo") as e:
        AlgorithmConfig(name="ppo")
    assert all(name in str(e.value) for name in ALGORITHMS)
    config = AlgorithmConfig()
    config.name = "ppo"  # set past the dataclass check
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'; registered algorithms: grpo"):
        get_algorithm(config, max_new_tokens=10)


@pytest.mark.parametrize(
    "name, estimator",
    [("grpo", grpo_advantages), ("drgrpo", drgrpo_advantages), ("dapo", grpo_advantages), ("rloo", rloo_advantages)],
)
def test_prepare_uses_the_algorithms_estimator(name, estimator):
    prepared = build(name).prepare(REWARDS, LENGTHS, G)
    assert torch.equal(prepared.advantages, estimator(REWARDS, G))
    assert torch.equal(prepared.rewards, REWARDS) and bool(prepared.keep.all())


def test_prepare_with_overlong_penalty_and_dynamic_sampling():
    algorithm = build("dapo", max_new_tokens=10, overlong_buffer=4, overlong_penalty_factor=0.5, dynamic_sampling=True)
    prepared = algorithm.prepare(REWARDS, LENGTHS, G)
    # lengths past 10 - 4 = 6 lose (|y| - 6) / 4 * 0.5, capped at 0.5:
    # 9 -> 0.375, 10 -> 0.5, 12 -> 0.5, 8 -> 0.25, 7 -> 0.125
    shaped = REWARDS - torch.tensor([0, 0.375, 0.5, 0.5, 0, 0, 0, 0, 0.25, 0, 0.125, 0])
    torch.testing.assert_close(prepared.rewards, shaped)
    torch.testing.assert_close(prepared.rewards, REWARDS + overlong_penalty(LENGTHS, 10, 4, 0.5))
    assert torch.equal(prepared.advantages, grpo_advantages(prepared.rewards, G))
    # the all-equal group 2 is dropped
    assert prepared.keep.tolist() == [True] * 4 + [False] * 4 + [True] * 4
    assert torch.equal(prepared.keep, groups_with_reward_variance(prepared.rewards, G).repeat_interleave(G))


def test_dynamic_sampling_keeps_everything_with_zero_advantages_when_no_group_varies():
    prepared = build("dapo", dynamic_sampling=True).prepare(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.ones(4), 2)
    assert bool(prepared.keep.all()) and torch.equal(prepared.advantages, torch.zeros(4))


def test_distillation_token_advantages():
    task = torch.tensor([0.5, 0.5, 0.5, -1.0, -1.0])
    student = torch.tensor([-1.0, -2.0, -0.5, -1.0, -1.0])
    teacher = torch.tensor([-1.5, -1.0, -0.5, -2.0, 0.0])
    mask = torch.tensor([False, True, True, True, True])
    teacher_only = build(teacher_path="teacher")
    assert teacher_only.needs_teacher and not teacher_only.needs_reference
    # teacher only (the default): -(log pi_student - log pi_teacher), the task advantage ignored
    expected = distillation_advantages(student, teacher) * mask
    assert torch.equal(teacher_only.token_advantages(task, student, teacher, mask), expected)
    torch.testing.assert_close(expected, torch.tensor([0.0, 1.0, 0.0, -1.0, 1.0]))
    # mixed: task + 0.5 * (teacher - student) = 0.25, 1, 0.5, -1.5, -0.5, then masked
    mixed = build(teacher_path="teacher", distillation_weight=0.5)
    torch.testing.assert_close(
        mixed.token_advantages(task, student, teacher, mask), torch.tensor([0.0, 1.0, 0.5, -1.5, -0.5])
    )


def test_reinforce_pp_whitens_over_the_loss_tokens():
    """Responses of 1 and 3 loss tokens, rewards 1 and 0 (groups of one): token returns 1, 0, 0, 0,
    mean 0.25, unbiased std 0.5 -> 1.5 and -0.5. Counting each response once (mean 0.5, std
    sqrt(0.5)) gives +-0.7071068."""
    rewards, lengths = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 3.0])
    for name in ("reinforce_pp", "reinforce_pp_baseline"):
        prepared = build(name).prepare(rewards, lengths, 1)
        torch.testing.assert_close(prepared.advantages, torch.tensor([1.5, -0.5]), atol=1e-5, rtol=0)
        prepared = build(name, advantage_whitening="response").prepare(rewards, lengths, 1)
        torch.testing.assert_close(prepared.advantages, torch.tensor([0.7071068, -0.7071068]), atol=1e-5, rtol=0)


def test_reinforce_pp_batch_statistics_count_only_the_kept_samples():
    """REINFORCE++-baseline, G = 2, rewards [1, 0 | 2, 2] with 1, 3, 5, 5 tokens. Dynamic sampling
    drops the second group, so the whitening is over the first group's 4 tokens: x = 0.5, -0.5;
    mean (0.5 - 1.5) / 4 = -0.25; variance (0.25 + 0.75 - 4 * 0.0625) / 3 = 0.25 -> 1.5, -0.5.
    Without dynamic sampling the 10 tokens of the second group (x = 0) count too: mean -1/14,
    variance (1 - 14 / 196) / 13 = 1/14 -> (0.5 + 1/14) * sqrt(14) = 2.1380899 and
    (-0.5 + 1/14) * sqrt(14) = -1.6035675, and 1/14 * sqrt(14) = 0.2672612 for the second group."""
    rewards, lengths = torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([1.0, 3.0, 5.0, 5.0])
    prepared = build("reinforce_pp_baseline", dynamic_sampling=True).prepare(rewards, lengths, 2)
    assert prepared.keep.tolist() == [True, True, False, False]
    torch.testing.assert_close(prepared.advantages, torch.tensor([1.5, -0.5, 0.0, 0.0]), atol=1e-5, rtol=0)
    prepared = build("reinforce_pp_baseline").prepare(rewards, lengths, 2)
    expected = torch.tensor([2.1380899, -1.6035675, 0.2672612, 0.2672612])
    torch.testing.assert_close(prepared.advantages, expected, atol=1e-5, rtol=0)


def test_groups_of_one():
    """REINFORCE++(-baseline) learn from one sample per prompt (the baseline variant has no group mean
    to subtract and whitens the rewards); the group-normalised algorithms and RLOO do not."""
    for name in ALGORITHMS:
        assert group_size_problem(name, 2) is None
        problem = group_size_problem(name, 1)
        if name in ("reinforce_pp", "reinforce_pp_baseline"):
            assert problem is None
        else:
            assert problem.startswith(f"algorithm {name!r} ") and "reinforce_pp, reinforce_pp_baseline" in problem
    # rewards 1, 0, 3, 3 of 1 token each: mean 1.75, unbiased std 1.5
    prepared = build("reinforce_pp_baseline").prepare(torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.ones(4), 1)
    torch.testing.assert_close(prepared.advantages, torch.tensor([-0.5, -1.75 / 1.5, 1.25 / 1.5, 1.25 / 1.5]))
    # with a teacher alone the reward advantages are not used, so a group of one is fine for any algorithm
    prepared = build("rloo", teacher_path="teacher").prepare(torch.tensor([1.0, 0.0]), torch.ones(2), 1)
    assert torch.equal(prepared.advantages, torch.zeros(2))


def test_mixed_distillation_clips_one_surrogate_of_the_summed_advantage():
    """A token with task advantage +1, distillation advantage -0.5 (weight 1) and ratio 1.5 > 1.2:
    its total advantage +0.5 is clipped as one surrogate, loss -1.2 * 0.5 and no gradient. (Two
    surrogates clipped apart would give -1.2 * 1 + 1.5 * 0.5 and a gradient of 0.75 from the
    distillation term.)"""
    algorithm = build("dapo", clip_high=0.2, teacher_path="teacher", distillation_weight=1.0)
    batch = PackedBatch.from_sequences([[0, 1]], prompt_lens=[1], advantages=[1.0])  # one loss token, at 0
    assert batch.loss_mask.tolist() == [True, False]
    batch.old_logprobs = torch.tensor([-1.0, 0.0])
    batch.advantages = algorithm.token_advantages(
        batch.advantages, batch.old_logprobs, torch.tensor([-1.5, 0.0]), batch.loss_mask
    )
    torch.testing.assert_close(batch.advantages, torch.tensor([0.5, 0.0]))
    logprobs = (batch.old_logprobs + torch.tensor([math.log(1.5), 0.0])).requires_grad_()
    loss, metrics = algorithm.loss(batch, logprobs, LossContext.for_batch(batch.loss_mask, batch.cu_seqlens))
    assert loss.item() == pytest.approx(-1.2 * 0.5, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.equal(grad, torch.zeros(2)) and metrics["clip_fraction"].item() == 1.0


def test_needs_reference_follows_the_kl_coefficient():
    assert not build().needs_reference and not build().needs_teacher
    assert build(kl_coef=0.01).needs_reference


def test_recipe_configs_parse():
    math = load_config_file(REPO / "recipes" / "configs" / "qwen3_math.yaml")
    assert math.algorithm.loss.importance_sampling == "token" and math.algorithm.loss.importance_cap == 2.0
    assert load_config_file(REPO / "recipes" / "configs" / "demo.yaml").algorithm.name == "grpo"
