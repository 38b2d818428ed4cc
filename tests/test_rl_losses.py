import math

import pytest
import torch

from archon.batch import PackedBatch
from archon.rl.algorithms import LossConfig, get_algorithm
from archon.rl.config import AlgorithmConfig
from archon.rl.losses import (
    aggregate_token_losses,
    icepop_weights,
    importance_weights,
    kl_penalty,
    ppo_clip_token_losses,
)
from archon.trainer import LossContext

# Two packed sequences: tokens 0-3 (token 0 is prompt) and 4-6 (token 4 is prompt).
CU_SEQLENS = torch.tensor([0, 4, 7])
MASK = torch.tensor([False, True, True, True, False, True, True])
LOGPROBS = [-7.0, -1.0, -2.0, -0.5, -9.0, -1.5, -3.0]
# pi_theta / pi_old per token; prompt positions are arbitrary
RATIOS = [1.0, 1.0, 1.25, 0.9, 3.0, 0.7, 1.1]
ADVANTAGES = torch.tensor([5.0, 1.0, 1.0, 1.0, 5.0, -1.0, -1.0])
ALGORITHMS = ["grpo", "drgrpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


def inputs(logprobs=LOGPROBS, ratios=RATIOS):
    logprobs = torch.tensor(logprobs, requires_grad=True)
    old = logprobs.detach() - torch.tensor(ratios).log()
    return logprobs, old


def grad_of(loss, logprobs):
    (grad,) = torch.autograd.grad(loss, logprobs)
    return grad


def algorithm(name, max_new_tokens=4, **loss):
    return get_algorithm(AlgorithmConfig(name=name, loss=LossConfig(**loss)), max_new_tokens)


def packed(old, advantages, mask=MASK, cu_seqlens=CU_SEQLENS, **fields) -> PackedBatch:
    """A packed batch with only what a loss reads (tokens and labels are placeholders)."""
    T = mask.numel()
    zeros = torch.zeros(T, dtype=torch.long)
    return PackedBatch(zeros, zeros, cu_seqlens, zeros, mask, advantages=advantages, old_logprobs=old, **fields)


def run_loss(
    name_or_algorithm, logprobs, old, advantages=ADVANTAGES, mask=MASK, cu_seqlens=CU_SEQLENS, ctx=None, **fields
):
    """The algorithm's loss on the whole batch as one micro-batch (ctx: its own counts)."""
    algo = algorithm(name_or_algorithm) if isinstance(name_or_algorithm, str) else name_or_algorithm
    ctx = ctx or LossContext.for_batch(mask, cu_seqlens)
    return algo.loss(packed(old, advantages, mask, cu_seqlens, **fields), logprobs, ctx)


def test_grpo_clipped_surrogate_seq_mean_token_mean():
    logprobs, old = inputs()
    loss, metrics = run_loss("grpo", logprobs, old)
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
    loss, metrics = run_loss("dapo", logprobs, old)
    # r = 1.25 is inside [0.8, 1.28], so only the r = 0.7 token (A < 0) is clipped
    assert loss.item() == pytest.approx((-1 - 1.25 - 0.9 + 0.8 + 1.1) / 5, abs=1e-6)
    expected_grad = [0.0, -0.2, -0.25, -0.18, 0.0, 0.0, 0.22]
    torch.testing.assert_close(grad_of(loss, logprobs), torch.tensor(expected_grad))
    assert metrics["clip_fraction"].item() == pytest.approx(0.2)


def test_drgrpo_divides_by_constant_length():
    logprobs, old = inputs()
    loss, _ = run_loss(algorithm("drgrpo", max_new_tokens=100, max_response_length=4), logprobs, old)
    # token sum -1.2, divided by max length 4 and 2 sequences
    assert loss.item() == pytest.approx(-0.15, abs=1e-6)
    expected_grad = [0.0, -0.125, 0.0, -0.1125, 0.0, 0.0, 0.1375]
    torch.testing.assert_close(grad_of(loss, logprobs), torch.tensor(expected_grad))
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate_token_losses(
            torch.zeros(7), MASK, CU_SEQLENS, "seq_mean_token_sum_norm", LossContext.for_batch(MASK, CU_SEQLENS)
        )


def test_gspo_sequence_level_ratio_and_gradient():
    # seq 0 log-ratios +1e-4, -1e-4, +3e-4: mean 1e-4, s_0 = e^1e-4 inside [1 - 3e-4, 1 + 4e-4]
    # seq 1 log-ratios 3.1e-3, -1e-4: mean 1.5e-3, s_1 = e^1.5e-3 > 1.0004, clipped for A = 0.5 > 0,
    # although the second token's own ratio e^-1e-4 is inside the range
    ratios = [1.0, math.exp(1e-4), math.exp(-1e-4), math.exp(3e-4), 1.0, math.exp(3.1e-3), math.exp(-1e-4)]
    logprobs, old = inputs(ratios=ratios)
    advantages = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.5])
    loss, metrics = run_loss("gspo", logprobs, old, advantages)
    s0 = math.exp(1e-4)
    assert loss.item() == pytest.approx((-s0 * 1.0 - 1.0004 * 0.5) / 2, abs=1e-6)
    # every token of seq 0 gets the same gradient -s_0 * A / |y_0| / N; seq 1 gets none
    g = -s0 / 3 / 2
    torch.testing.assert_close(grad_of(loss, logprobs), torch.tensor([0.0, g, g, g, 0.0, 0.0, 0.0]), atol=1e-7, rtol=0)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 5)
    assert metrics["seq_ratio_mean"].item() == pytest.approx((s0 + math.exp(1.5e-3)) / 2, abs=1e-6)


def test_cispo_keeps_gradient_on_every_token():
    logprobs, old = inputs()
    loss, metrics = run_loss(algorithm("cispo", clip_low=0.2, clip_high=0.2), logprobs, old)
    # weights sg(clip(r, 0.8, 1.2)) = 1, 1.2, 0.9, 0.8, 1.1; loss = -sum w * A * logp / 5
    assert loss.item() == pytest.approx(-(-1.0 - 2.4 - 0.45 + 1.2 + 3.3) / 5, abs=1e-6)
    expected_grad = [0.0, -0.2, -0.24, -0.18, 0.0, 0.16, 0.22]
    grad = grad_of(loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor(expected_grad))
    assert (grad[MASK] != 0).all()
    assert metrics["clip_fraction"].item() == pytest.approx(0.4)


def test_cispo_default_has_no_lower_bound():
    logprobs, old = inputs(ratios=[1.0, 0.01, 6.0, 1.0, 1.0, 1.0, 1.0])
    loss, metrics = run_loss("cispo", logprobs, old)
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
    mask, cu_seqlens = torch.ones(3, dtype=torch.bool), torch.tensor([0, 3])
    loss = aggregate_token_losses(k3, mask, cu_seqlens, "token_mean", LossContext.for_batch(mask, cu_seqlens))
    assert loss.item() == pytest.approx(0.8248125 / 3, abs=1e-6)
    with pytest.raises(ValueError):
        kl_penalty(logprobs, ref, "k4")


def test_k3_cap_clamps_large_tokens_only():
    logprobs = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5])
    capped = kl_penalty(logprobs, ref, "k3", cap=0.5)
    # k3 = 0.1065307, 0.7182818, 0: only the second is above the cap; it keeps no gradient
    torch.testing.assert_close(capped, torch.tensor([0.1065307, 0.5, 0.0]))
    torch.testing.assert_close(grad_of(capped.sum(), logprobs), torch.tensor([0.3934693, 0.0, 0.0]))
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(logprobs, ref, "k2", cap=0.5)


def test_kl_cap_in_the_loss():
    logprobs, old = inputs()
    ref = logprobs.detach() + torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0])  # d = 1 and 2 on two tokens
    loss, metrics = run_loss(algorithm("dapo", kl_coef=0.1, kl_cap=1.0), logprobs, old, ref_logprobs=ref)
    base, _ = run_loss("dapo", logprobs, old)
    # k3: e - 2 = 0.7182818 (under the cap), e^2 - 3 = 4.389 capped to 1; the rest 0
    assert metrics["kl"].item() == pytest.approx((math.e - 2 + 1.0) / 5, abs=1e-6)
    assert loss.item() == pytest.approx(base.item() + 0.1 * (math.e - 2 + 1.0) / 5, abs=1e-6)


def test_token_importance_weights():
    old = torch.tensor([-1.0, -1.0, -2.0])
    rollout = torch.tensor([-1.0, -2.0, -1.0])
    mask, cu_seqlens = torch.ones(3, dtype=torch.bool), torch.tensor([0, 3])
    weights, metrics = importance_weights(old, rollout, mask, cu_seqlens, "token", cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([1.0, 2.0, 0.3678794]))  # e^1 capped at 2
    assert metrics["tis_clip_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["rollout_logprob_abs_diff"].item() == pytest.approx(2 / 3)


def test_tis_weights_scale_token_losses():
    logprobs, old = inputs()
    rollout = old - torch.tensor([0.0, 0.0, math.log(2.0), math.log(0.5), 0.0, 0.0, 0.0])
    loss, _ = run_loss(
        algorithm("dapo", importance_sampling="token", importance_cap=2.0), logprobs, old, rollout_logprobs=rollout
    )
    # DAPO token losses -1, -1.25, -0.9, 0.8, 1.1 weighted by 1, 2, 0.5, 1, 1
    assert loss.item() == pytest.approx((-1 - 2.5 - 0.45 + 0.8 + 1.1) / 5, abs=1e-6)


def test_sequence_importance_weights():
    """One weight per sequence: exp of the sum of its response tokens' log pi_old - log mu, capped.
    seq 0: 0.3 - 0.1 + 0.5 = 0.7, e^0.7 = 2.0138 > 2, capped to 2; seq 1: -0.2 - 0.3 = -0.5,
    e^-0.5 = 0.6065307. The prompt tokens' log-ratios (7 and -9) are not summed."""
    rollout = torch.tensor([-1.0, -1.0, -2.0, -0.5, -3.0, -1.5, -3.0])
    old = rollout + torch.tensor([7.0, 0.3, -0.1, 0.5, -9.0, -0.2, -0.3])
    weights, metrics = importance_weights(old, rollout, MASK, CU_SEQLENS, "sequence", cap=2.0)
    w1 = math.exp(-0.5)
    torch.testing.assert_close(weights, torch.tensor([2.0, 2.0, 2.0, 2.0, w1, w1, w1]))
    assert metrics["tis_weight_mean"].item() == pytest.approx((3 * 2.0 + 2 * w1) / 5, abs=1e-6)
    assert metrics["tis_clip_fraction"].item() == pytest.approx(3 / 5)
    assert metrics["rollout_logprob_abs_diff"].item() == pytest.approx((0.3 + 0.1 + 0.5 + 0.2 + 0.3) / 5, abs=1e-6)
    # in the loss: DAPO token losses -1, -1.25, -0.9, 0.8, 1.1 weighted by 2, 2, 2, w1, w1
    logprobs, old_policy = inputs()
    rollout = old_policy - (old - rollout)
    algo = algorithm("dapo", importance_sampling="sequence")
    loss, _ = run_loss(algo, logprobs, old_policy, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx((2 * (-1 - 1.25 - 0.9) + w1 * (0.8 + 1.1)) / 5, abs=1e-6)


def test_decoupled_ppo_objective():
    """pi_prox = old_logprobs (the trainer's score before the update), mu = rollout_logprobs. The PPO
    ratio is pi / pi_prox, clipped; each token's loss is multiplied by min(pi_prox / mu, 2).
    log(pi_prox / mu) = 0.3, -0.2, 1.0, 0.1, -0.9 on the response tokens: weights 1.3498588,
    0.8187308, 2 (e^1 capped), 1.1051709, 0.4065697; DAPO token losses -1, -1.25, -0.9, 0.8, 1.1."""
    logprobs, prox = inputs()
    behaviour = prox - torch.tensor([0.0, 0.3, -0.2, 1.0, 0.0, 0.1, -0.9])
    algo = algorithm("dapo", importance_sampling="token", importance_cap=2.0)
    loss, metrics = run_loss(algo, logprobs, prox, rollout_logprobs=behaviour)
    weights = [1.3498588, 0.8187308, 2.0, 1.1051709, 0.4065697]
    token_losses = [-1.0, -1.25, -0.9, 0.8, 1.1]
    assert loss.item() == pytest.approx(sum(w * t for w, t in zip(weights, token_losses)) / 5, abs=1e-6)
    assert loss.item() == pytest.approx(-0.5683818, abs=1e-6)
    # gradient: w * (-A r) / 5 on unclipped tokens; the clipped r = 0.7 token (A < 0) gets none
    expected_grad = [0.0, -1.3498588 / 5, -0.8187308 * 1.25 / 5, -2.0 * 0.9 / 5, 0.0, 0.0, 0.4065697 * 1.1 / 5]
    torch.testing.assert_close(grad_of(loss, logprobs), torch.tensor(expected_grad))
    assert metrics["ratio_max"].item() == pytest.approx(1.25)  # the ratio is against pi_prox, not mu
    assert metrics["tis_clip_fraction"].item() == pytest.approx(0.2)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        run_loss(algo, logprobs, prox)


def test_dual_clip_bounds_negative_advantage_tokens_only():
    """loss_t = min(max(-A r, -A clip(r, 0.8, 1.2)), -A c) for A < 0, c = 3; unchanged for A >= 0.
    A=-1,   r=4:   max(4, 1.2) = 4 > 3         -> 3    (changed)
    A=-1,   r=2:   max(2, 1.2) = 2 <= 3        -> 2    (A < 0, r <= c: unchanged)
    A=+1,   r=4:   max(-4, -1.2) = -1.2        -> -1.2 (A >= 0: unchanged, although r > c)
    A=-2,   r=0.5: max(1, 1.6) = 1.6 <= 6      -> 1.6  (unchanged)
    A=-0.5, r=5:   max(2.5, 0.6) = 2.5 > 1.5   -> 1.5  (changed)"""
    ratios = torch.tensor([4.0, 2.0, 4.0, 0.5, 5.0])
    advantages = torch.tensor([-1.0, -1.0, 1.0, -2.0, -0.5])
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0], requires_grad=True)
    old = logprobs.detach() - ratios.log()
    mask, cu_seqlens = torch.ones(5, dtype=torch.bool), torch.tensor([0, 5])
    plain, _, _ = ppo_clip_token_losses(logprobs, old, advantages, mask, cu_seqlens, clip_low=0.2, clip_high=0.2)
    dual, _, extra = ppo_clip_token_losses(
        logprobs, old, advantages, mask, cu_seqlens, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0
    )
    torch.testing.assert_close(plain, torch.tensor([4.0, 2.0, -1.2, 1.6, 2.5]))
    torch.testing.assert_close(dual, torch.tensor([3.0, 2.0, -1.2, 1.6, 1.5]))
    assert (dual != plain).tolist() == [True, False, False, False, True]
    assert extra["dual_clip_fraction"].item() == pytest.approx(2 / 5)
    # the bounded tokens get no gradient; the others keep plain PPO's (-A r on the unclipped branch)
    torch.testing.assert_close(grad_of(dual.sum(), logprobs), torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0]))
    # through the algorithm (token mean over the 5 tokens)
    loss, metrics = run_loss(
        algorithm("dapo", clip_high=0.2, clip_ratio_c=3.0), logprobs, old, advantages, mask, cu_seqlens
    )
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2 + 1.6 + 1.5) / 5, abs=1e-6)
    assert metrics["dual_clip_fraction"].item() == pytest.approx(2 / 5)


def test_icepop_weights_kept_tokens_by_their_ratio():
    """Band [0.5, 2] on pi_old / mu: the ratios 3 and 0.4 are outside (weight 0), the edges 2 and 0.5
    inside and weighted by themselves; the prompt token's ratio of 10 is not counted (it is not in
    the loss mask)."""
    old = torch.tensor([-1.0, -1.0, -2.0, -0.5, -3.0, -1.5, -3.0])
    rollout = old - torch.tensor([10.0, 1.0, 3.0, 0.4, 1.0, 2.0, 0.5]).log()
    weights, metrics = icepop_weights(old, rollout, MASK, low=0.5, high=2.0)
    torch.testing.assert_close(weights, torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 2.0, 0.5]))
    assert metrics["icepop_masked_fraction"].item() == pytest.approx(2 / 5)
    assert metrics["tis_weight_mean"].item() == pytest.approx(3.5 / 5)
    # |log ratio| over the response tokens: 0, log 3, log 2.5, log 2, log 2
    expected_diff = (math.log(3) + math.log(2.5) + 2 * math.log(2)) / 5
    assert metrics["rollout_logprob_abs_diff"].item() == pytest.approx(expected_diff, abs=1e-6)
    # ratio pi / pi_old = 1, A = 1: DAPO token losses -1 each, times the weights 1, 0, 0, 2, 0.5;
    # the tokens outside the band give 0 and no gradient; the normaliser still counts all 5 response
    # tokens. IcePop without importance_sampling set is token-level: the default is token.
    logprobs = old.clone().requires_grad_()
    advantages = torch.ones(7)
    icepop = algorithm("dapo", icepop_band=(0.5, 2.0))
    assert icepop.importance_sampling == "token"
    loss, metrics = run_loss(icepop, logprobs, old, advantages, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-(1 + 2 + 0.5) / 5, abs=1e-6)
    torch.testing.assert_close(grad_of(loss, logprobs), torch.tensor([0.0, -0.2, 0.0, 0.0, 0.0, -0.4, -0.1]))
    assert metrics["icepop_masked_fraction"].item() == pytest.approx(2 / 5)


def test_icepop_band_replaces_the_truncation():
    """Band (0.5, 5), token importance sampling with the cap 2: a ratio pi_old / mu of 3 is inside
    the band and weighs 3 (truncated importance sampling alone would give it 2); 6 is outside (0).
    DAPO token losses at ratio pi / pi_old = 1 and A = 1: -1 each, over 5 response tokens."""
    old = torch.tensor([-1.0, -1.0, -2.0, -0.5, -3.0, -1.5, -3.0])
    rollout = old - torch.tensor([1.0, 3.0, 6.0, 1.0, 1.0, 1.0, 1.0]).log()
    logprobs = old.clone().requires_grad_()
    advantages = torch.ones(7)
    icepop = algorithm("dapo", icepop_band=(0.5, 5.0), importance_sampling="token", importance_cap=2.0)
    loss, metrics = run_loss(icepop, logprobs, old, advantages, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-(3 + 0 + 1 + 1 + 1) / 5, abs=1e-6)
    torch.testing.assert_close(grad_of(loss, logprobs), torch.tensor([0.0, -0.6, 0.0, -0.2, 0.0, -0.2, -0.2]))
    assert "tis_clip_fraction" not in metrics  # nothing is truncated
    truncated, _ = run_loss(
        algorithm("dapo", importance_sampling="token", importance_cap=2.0),
        logprobs,
        old,
        advantages,
        rollout_logprobs=rollout,
    )
    assert truncated.item() == pytest.approx(-(2 + 2 + 1 + 1 + 1) / 5, abs=1e-6)


@pytest.mark.parametrize("level", ["sequence", "none"])
def test_icepop_is_token_level_importance_sampling(level):
    with pytest.raises(ValueError, match=f"algorithm.loss.importance_sampling='{level}': IcePop"):
        algorithm("dapo", icepop_band=(0.5, 5.0), importance_sampling=level)


def test_entropy_bonus_uses_the_policy_loss_aggregation():
    logprobs, old = inputs()
    entropy = torch.tensor([9.0, 1.0, 2.0, 3.0, 9.0, 0.5, 1.5], requires_grad=True)
    mask_ctx = LossContext.for_batch(MASK, CU_SEQLENS, entropy=entropy)
    base, _ = run_loss("grpo", logprobs, old)
    loss, metrics = run_loss(algorithm("grpo", entropy_coef=0.1), logprobs, old, ctx=mask_ctx)
    # seq_mean_token_mean of the entropy: (2 + 1) / 2 = 1.5
    assert loss.item() == pytest.approx(base.item() - 0.1 * 1.5, abs=1e-6)
    assert metrics["entropy_bonus"].item() == pytest.approx(1.5)
    assert metrics["entropy"].item() == pytest.approx(8 / 5)  # token mean, reported either way
    torch.testing.assert_close(grad_of(loss, entropy), torch.tensor([0.0, *[-0.1 / 6] * 3, 0.0, *[-0.1 / 4] * 2]))
    with pytest.raises(ValueError, match="entropy"):
        run_loss(algorithm("grpo", entropy_coef=0.1), logprobs, old)


def test_policy_loss_combines_algorithm_kl_and_tis():
    logprobs, old = inputs()
    ref = logprobs.detach() - 0.1
    rollout = old + torch.tensor([0.0, 0.3, -0.2, 1.0, 0.0, 0.1, -0.9])
    algo = algorithm("dapo", kl_coef=0.1, kl_estimator="k2", importance_sampling="token", importance_cap=2.0)
    loss, metrics = run_loss(algo, logprobs, old, ref_logprobs=ref, rollout_logprobs=rollout)
    pg, _ = run_loss(algorithm("dapo", importance_sampling="token"), logprobs, old, rollout_logprobs=rollout)
    kl = aggregate_token_losses(
        kl_penalty(logprobs, ref, "k2"), MASK, CU_SEQLENS, "token_mean", LossContext.for_batch(MASK, CU_SEQLENS)
    )
    assert loss.item() == pytest.approx((pg + 0.1 * kl).item(), abs=1e-6)
    # k2 with logp - ref = 0.1 on every token: 0.005
    assert metrics["kl"].item() == pytest.approx(0.005, abs=1e-6)
    for key in ("loss", "policy_loss", "clip_fraction", "approx_kl", "tis_weight_mean", "rollout_logprob_abs_diff"):
        assert key in metrics
    with pytest.raises(ValueError, match="ref_logprobs"):
        run_loss(algo, logprobs, old, rollout_logprobs=rollout)
    with pytest.raises(ValueError, match="unknown algorithm"):
        AlgorithmConfig(name="ppo")
    dapo = algorithm("dapo")
    assert (dapo.clip_low, dapo.clip_high) == (0.2, 0.28)
    gspo = algorithm("gspo", clip_high=1e-3)
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 1e-3)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_zero_length_response_changes_nothing(name):
    algo = algorithm(name, max_response_length=4)
    logprobs, old = inputs()
    base, _ = run_loss(algo, logprobs, old)
    # the same batch with a third sequence that is all prompt (an empty response) in the middle
    lp2, old2 = inputs(LOGPROBS[:4] + [-2.0, -2.0] + LOGPROBS[4:], RATIOS[:4] + [1.5, 0.5] + RATIOS[4:])
    mask2 = torch.cat([MASK[:4], torch.tensor([False, False]), MASK[4:]])
    adv2 = torch.cat([ADVANTAGES[:4], torch.tensor([3.0, 3.0]), ADVANTAGES[4:]])
    cu2 = torch.tensor([0, 4, 6, 9])
    ctx2, ctx = LossContext.for_batch(mask2, cu2), LossContext.for_batch(MASK, CU_SEQLENS)
    assert (ctx2.global_tokens, ctx2.global_sequences) == (ctx.global_tokens, ctx.global_sequences)
    loss, _ = run_loss(algo, lp2, old2, adv2, mask2, cu2)
    assert loss.item() == pytest.approx(base.item(), abs=1e-7)
    assert torch.equal(grad_of(loss, lp2)[4:6], torch.zeros(2))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_batch_without_response_tokens_gives_zero_loss(name):
    logprobs, old = inputs()
    no_response = torch.zeros(7, dtype=torch.bool)
    loss, metrics = run_loss(algorithm(name, max_response_length=4), logprobs, old, mask=no_response)
    assert loss.item() == 0.0
    assert torch.equal(grad_of(loss, logprobs), torch.zeros(7))
    assert metrics["num_tokens"].item() == 0 and metrics["clip_fraction"].item() == 0.0


@pytest.mark.parametrize("name", ALGORITHMS)
def test_micro_batches_with_global_normalizer_sum_to_full_batch(name):
    torch.manual_seed(0)
    lengths = [5, 3, 6, 4]
    cu = torch.tensor([0, 5, 8, 14, 18])
    logprobs = (-torch.rand(18) * 3).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(18)
    ref = logprobs.detach() + 0.2 * torch.randn(18)
    advantages = torch.randn(4).repeat_interleave(torch.tensor(lengths))
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    algo = algorithm(name, max_response_length=6, kl_coef=0.05)
    batch = packed(old, advantages, mask, cu, ref_logprobs=ref)
    whole = LossContext.for_batch(mask, cu)
    full, _ = algo.loss(batch, logprobs, whole)
    full_grad = grad_of(full, logprobs)

    # micro-batches: sequences {0, 1} = tokens 0-7 and {2, 3} = tokens 8-17
    parts = [([0, 1], slice(0, 8)), ([2, 3], slice(8, 18))]
    total = sum(algo.loss(batch.select(seqs), logprobs[s], whole)[0] for seqs, s in parts)
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(grad_of(total, logprobs), full_grad)
    # without the global counts each micro-batch would be normalised on its own: a different loss
    local = 0.0
    for seqs, s in parts:
        part = batch.select(seqs)
        local = local + algo.loss(part, logprobs[s], LossContext.for_batch(part.loss_mask, part.cu_seqlens))[0]
    assert abs(local.item() - full.item()) > 1e-3


def test_shape_mismatch_is_an_error():
    logprobs, old = inputs()
    batch = packed(old, ADVANTAGES)
    batch.advantages = ADVANTAGES[:3]
    with pytest.raises(ValueError, match="advantages"):
        algorithm("grpo").loss(batch, logprobs, LossContext.for_batch(MASK, CU_SEQLENS))


def test_max_response_length_defaults_to_the_generation_limit():
    assert algorithm("drgrpo", max_new_tokens=256).max_response_length == 256
    assert algorithm("drgrpo", max_new_tokens=256, max_response_length=100).max_response_length == 100
    with pytest.raises(ValueError, match="LossConfig.max_response_length must be positive, got 0"):
        LossConfig(max_response_length=0)
