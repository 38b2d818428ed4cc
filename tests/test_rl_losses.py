import math

import pytest
import torch

from archon.rl.losses import (
    LossConfig,
    aggregate_token_losses,
    cispo_loss,
    dapo_loss,
    drgrpo_loss,
    grpo_loss,
    gspo_loss,
    kl_loss,
    kl_penalty,
    loss_normalizer,
    policy_loss,
    truncated_importance_weights,
)

# Two packed sequences: tokens 0-3 (token 0 is prompt) and 4-6 (token 4 is prompt).
CU_SEQLENS = torch.tensor([0, 4, 7])
MASK = torch.tensor([False, True, True, True, False, True, True])
LOGPROBS = [-7.0, -1.0, -2.0, -0.5, -9.0, -1.5, -3.0]
# pi_theta / pi_old per token; prompt positions are arbitrary
RATIOS = [1.0, 1.0, 1.25, 0.9, 3.0, 0.7, 1.1]
ADVANTAGES = torch.tensor([5.0, 1.0, 1.0, 1.0, 5.0, -1.0, -1.0])


def inputs(logprobs=LOGPROBS, ratios=RATIOS):
    logprobs = torch.tensor(logprobs, requires_grad=True)
    old = logprobs.detach() - torch.tensor(ratios).log()
    return logprobs, old


def grad_of(loss, logprobs):
    (grad,) = torch.autograd.grad(loss, logprobs)
    return grad


def test_grpo_clipped_surrogate_seq_mean_token_mean():
    logprobs, old = inputs()
    loss, metrics = grpo_loss(logprobs, old, ADVANTAGES, MASK, CU_SEQLENS)
    # per-token -min(rA, clip(r, 0.8, 1.2)A): seq 0: -1, -1.2 (clipped), -0.9; seq 1: 0.8 (clipped), 1.1
    # seq means: -3.1/3 and 1.9/2; batch mean of the two
    assert loss.item() == pytest.approx((-3.1 / 3 + 0.95) / 2, abs=1e-6)
    expected_grad = [0.0, -1 / 6, 0.0, -0.9 / 6, 0.0, 0.0, 1.1 / 4]
    torch.testing.assert_close(grad_of(loss, logprobs), torch.tensor(expected_grad))
    assert metrics["clip_fraction"].item() == pytest.approx(0.4)
    # mean of (r - 1) - log r over the five response tokens
    assert metrics["approx_kl"].item() == pytest.approx(0.0935816 / 5, abs=1e-6)
    assert metrics["ratio_max"].item() == pytest.approx(1.25)
    assert metrics["num_tokens"].item() == 5
    assert not metrics["policy_loss"].requires_grad


def test_dapo_clip_higher_and_token_mean():
    logprobs, old = inputs()
    loss, metrics = dapo_loss(logprobs, old, ADVANTAGES, MASK, CU_SEQLENS)
    # r = 1.25 is inside [0.8, 1.28], so only the r = 0.7 token (A < 0) is clipped
    assert loss.item() == pytest.approx((-1 - 1.25 - 0.9 + 0.8 + 1.1) / 5, abs=1e-6)
    expected_grad = [0.0, -0.2, -0.25, -0.18, 0.0, 0.0, 0.22]
    torch.testing.assert_close(grad_of(loss, logprobs), torch.tensor(expected_grad))
    assert metrics["clip_fraction"].item() == pytest.approx(0.2)


def test_drgrpo_divides_by_constant_length():
    logprobs, old = inputs()
    loss, _ = drgrpo_loss(logprobs, old, ADVANTAGES, MASK, CU_SEQLENS, max_response_length=4)
    # token sum -1.2, divided by max length 4 and 2 sequences
    assert loss.item() == pytest.approx(-0.15, abs=1e-6)
    expected_grad = [0.0, -0.125, 0.0, -0.1125, 0.0, 0.0, 0.1375]
    torch.testing.assert_close(grad_of(loss, logprobs), torch.tensor(expected_grad))
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate_token_losses(torch.zeros(7), MASK, CU_SEQLENS, "seq_mean_token_sum_norm")


def test_gspo_sequence_level_ratio_and_gradient():
    # seq 0 log-ratios +1e-4, -1e-4, +3e-4: mean 1e-4, s_0 = e^1e-4 inside [1 - 3e-4, 1 + 4e-4]
    # seq 1 log-ratios 3.1e-3, -1e-4: mean 1.5e-3, s_1 = e^1.5e-3 > 1.0004, clipped for A = 0.5 > 0,
    # although the second token's own ratio e^-1e-4 is inside the range
    ratios = [1.0, math.exp(1e-4), math.exp(-1e-4), math.exp(3e-4), 1.0, math.exp(3.1e-3), math.exp(-1e-4)]
    logprobs, old = inputs(ratios=ratios)
    advantages = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.5])
    loss, metrics = gspo_loss(logprobs, old, advantages, MASK, CU_SEQLENS)
    s0 = math.exp(1e-4)
    assert loss.item() == pytest.approx((-s0 * 1.0 - 1.0004 * 0.5) / 2, abs=1e-6)
    # every token of seq 0 gets the same gradient -s_0 * A / |y_0| / N; seq 1 gets none
    g = -s0 / 3 / 2
    torch.testing.assert_close(grad_of(loss, logprobs), torch.tensor([0.0, g, g, g, 0.0, 0.0, 0.0]), atol=1e-7, rtol=0)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 5)
    assert metrics["seq_ratio_mean"].item() == pytest.approx((s0 + math.exp(1.5e-3)) / 2, abs=1e-6)


def test_cispo_keeps_gradient_on_every_token():
    logprobs, old = inputs()
    loss, metrics = cispo_loss(logprobs, old, ADVANTAGES, MASK, CU_SEQLENS, clip_low=0.2, clip_high=0.2)
    # weights sg(clip(r, 0.8, 1.2)) = 1, 1.2, 0.9, 0.8, 1.1; loss = -sum w * A * logp / 5
    assert loss.item() == pytest.approx(-(-1.0 - 2.4 - 0.45 + 1.2 + 3.3) / 5, abs=1e-6)
    expected_grad = [0.0, -0.2, -0.24, -0.18, 0.0, 0.16, 0.22]
    grad = grad_of(loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor(expected_grad))
    assert (grad[MASK] != 0).all()
    assert metrics["clip_fraction"].item() == pytest.approx(0.4)


def test_cispo_default_has_no_lower_bound():
    logprobs, old = inputs(ratios=[1.0, 0.01, 6.0, 1.0, 1.0, 1.0, 1.0])
    loss, metrics = cispo_loss(logprobs, old, ADVANTAGES, MASK, CU_SEQLENS)
    # weights 0.01 (kept: no lower bound), 5 (capped at 1 + 4), 1, 1, 1
    assert loss.item() == pytest.approx(-(0.01 * -1.0 + 5 * -2.0 - 0.5 + 1.5 + 3.0) / 5, abs=1e-6)
    assert metrics["clip_fraction"].item() == pytest.approx(0.2)


def test_kl_estimators():
    logprobs = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5])  # d = ref - logp = -0.5, 1, 0
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k1"), torch.tensor([0.5, -1.0, 0.0]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k2"), torch.tensor([0.125, 0.5, 0.0]))
    k3 = kl_penalty(logprobs, ref, "k3")
    torch.testing.assert_close(k3, torch.tensor([0.1065307, 0.7182818, 0.0]))
    # d k3 / d logp = 1 - e^d
    torch.testing.assert_close(grad_of(k3.sum(), logprobs), torch.tensor([0.3934693, -1.7182818, 0.0]))
    loss, metrics = kl_loss(logprobs, ref, torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]))
    assert loss.item() == pytest.approx(0.8248125 / 3, abs=1e-6)
    assert metrics["kl"].item() == pytest.approx(0.8248125 / 3, abs=1e-6)
    with pytest.raises(ValueError):
        kl_penalty(logprobs, ref, "k4")


def test_truncated_importance_weights():
    old = torch.tensor([-1.0, -1.0, -2.0])
    rollout = torch.tensor([-1.0, -2.0, -1.0])
    weights, metrics = truncated_importance_weights(old, rollout, cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([1.0, 2.0, 0.3678794]))  # e^1 capped at 2
    assert metrics["tis_clip_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["rollout_logprob_abs_diff"].item() == pytest.approx(2 / 3)


def test_tis_weights_scale_token_losses():
    logprobs, old = inputs()
    rollout = old - torch.tensor([0.0, 0.0, math.log(2.0), math.log(0.5), 0.0, 0.0, 0.0])
    weights, _ = truncated_importance_weights(old, rollout, cap=2.0)
    loss, _ = dapo_loss(logprobs, old, ADVANTAGES, MASK, CU_SEQLENS, tis_weights=weights)
    # DAPO token losses -1, -1.25, -0.9, 0.8, 1.1 weighted by 1, 2, 0.5, 1, 1
    assert loss.item() == pytest.approx((-1 - 2.5 - 0.45 + 0.8 + 1.1) / 5, abs=1e-6)


def test_policy_loss_combines_algorithm_kl_and_tis():
    logprobs, old = inputs()
    ref = logprobs.detach() - 0.1
    rollout = old + torch.tensor([0.0, 0.3, -0.2, 1.0, 0.0, 0.1, -0.9])
    config = LossConfig(algorithm="dapo", kl_coef=0.1, kl_estimator="k2", tis_cap=2.0)
    loss, metrics = policy_loss(
        config, logprobs, old, ADVANTAGES, MASK, CU_SEQLENS, ref_logprobs=ref, rollout_logprobs=rollout
    )
    weights, _ = truncated_importance_weights(old, rollout, 2.0)
    pg, _ = dapo_loss(logprobs, old, ADVANTAGES, MASK, CU_SEQLENS, tis_weights=weights)
    kl, _ = kl_loss(logprobs, ref, MASK, CU_SEQLENS, estimator="k2")
    assert loss.item() == pytest.approx((pg + 0.1 * kl).item(), abs=1e-6)
    # k2 with logp - ref = 0.1 on every token: 0.005
    assert metrics["kl"].item() == pytest.approx(0.005, abs=1e-6)
    for key in ("loss", "policy_loss", "clip_fraction", "approx_kl", "tis_weight_mean", "rollout_logprob_abs_diff"):
        assert key in metrics
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(config, logprobs, old, ADVANTAGES, MASK, CU_SEQLENS, rollout_logprobs=rollout)
    with pytest.raises(ValueError, match="max_response_length"):
        policy_loss(LossConfig(algorithm="drgrpo"), logprobs, old, ADVANTAGES, MASK, CU_SEQLENS)
    with pytest.raises(ValueError, match="unknown algorithm"):
        LossConfig(algorithm="ppo")
    assert LossConfig(algorithm="dapo").resolved_clip() == (0.2, 0.28)
    assert LossConfig(algorithm="gspo", clip_high=1e-3).resolved_clip() == (3e-4, 1e-3)


ALGORITHMS = ["grpo", "drgrpo", "dapo", "gspo", "cispo"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_zero_length_response_changes_nothing(algorithm):
    config = LossConfig(algorithm=algorithm, max_response_length=4)
    logprobs, old = inputs()
    base, _ = policy_loss(config, logprobs, old, ADVANTAGES, MASK, CU_SEQLENS)
    # the same batch with a third sequence that is all prompt (an empty response) in the middle
    lp2, old2 = inputs(LOGPROBS[:4] + [-2.0, -2.0] + LOGPROBS[4:], RATIOS[:4] + [1.5, 0.5] + RATIOS[4:])
    mask2 = torch.cat([MASK[:4], torch.tensor([False, False]), MASK[4:]])
    adv2 = torch.cat([ADVANTAGES[:4], torch.tensor([3.0, 3.0]), ADVANTAGES[4:]])
    cu2 = torch.tensor([0, 4, 6, 9])
    assert loss_normalizer(mask2, cu2, config.resolved_aggregation()).item() == loss_normalizer(
        MASK, CU_SEQLENS, config.resolved_aggregation()
    ).item()
    loss, _ = policy_loss(config, lp2, old2, adv2, mask2, cu2)
    assert loss.item() == pytest.approx(base.item(), abs=1e-7)
    assert torch.equal(grad_of(loss, lp2)[4:6], torch.zeros(2))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_batch_without_response_tokens_gives_zero_loss(algorithm):
    config = LossConfig(algorithm=algorithm, max_response_length=4)
    logprobs, old = inputs()
    loss, metrics = policy_loss(config, logprobs, old, ADVANTAGES, torch.zeros(7, dtype=torch.bool), CU_SEQLENS)
    assert loss.item() == 0.0
    assert torch.equal(grad_of(loss, logprobs), torch.zeros(7))
    assert metrics["num_tokens"].item() == 0 and metrics["clip_fraction"].item() == 0.0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_micro_batches_with_global_normalizer_sum_to_full_batch(algorithm):
    torch.manual_seed(0)
    lengths = [5, 3, 6, 4]
    cu = torch.tensor([0, 5, 8, 14, 18])
    logprobs = (-torch.rand(18) * 3).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(18)
    ref = logprobs.detach() + 0.2 * torch.randn(18)
    advantages = torch.randn(4).repeat_interleave(torch.tensor(lengths))
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    config = LossConfig(algorithm=algorithm, max_response_length=6, kl_coef=0.05)
    full, _ = policy_loss(config, logprobs, old, advantages, mask, cu, ref_logprobs=ref)
    full_grad = grad_of(full, logprobs)

    # micro-batches: sequences {0, 1} = tokens 0-7 and {2, 3} = tokens 8-17
    parts = [(slice(0, 8), torch.tensor([0, 5, 8])), (slice(8, 18), torch.tensor([0, 6, 10]))]
    aggregation = config.resolved_aggregation()
    normalizer = sum(loss_normalizer(mask[s], c, aggregation) for s, c in parts)
    total = 0.0
    for s, c in parts:
        loss, _ = policy_loss(
            config, logprobs[s], old[s], advantages[s], mask[s], c, normalizer=normalizer, ref_logprobs=ref[s]
        )
        total = total + loss
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(grad_of(total, logprobs), full_grad)
    # without the global normaliser each micro-batch would be normalised on its own: a different loss
    local = sum(
        policy_loss(config, logprobs[s], old[s], advantages[s], mask[s], c, ref_logprobs=ref[s])[0] for s, c in parts
    )
    assert abs(local.item() - full.item()) > 1e-3


def test_shape_mismatch_is_an_error():
    logprobs, old = inputs()
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logprobs, old, ADVANTAGES[:3], MASK, CU_SEQLENS)


def test_max_response_length_defaults_to_the_generation_limit():
    assert LossConfig(algorithm="drgrpo").for_rollout(256).max_response_length == 256
    assert LossConfig(algorithm="drgrpo", max_response_length=100).for_rollout(256).max_response_length == 100
    with pytest.raises(ValueError, match="LossConfig.max_response_length must be positive, got 0"):
        LossConfig(max_response_length=0)
