"""Policy-loss math for the GRPO family: pure functions over packed per-token tensors.

Inputs (all per-token tensors have shape [T], the packed layout of the model forward):
    logprobs          log pi_theta(y_t), with gradient
    old_logprobs      log pi_old(y_t), the policy that the PPO ratio refers to (no gradient); in the
                      decoupled objective this is the proximal policy pi_prox, the trainer's own
                      score of the batch before the update
    rollout_logprobs  log mu(y_t), the behaviour policy that sampled the tokens (rollout engine)
    advantages        per-token advantages; broadcast a per-sequence advantage with
                      `archon.rl.algorithms.advantages.expand_to_tokens`
    loss_mask         bool or 0/1, true on the response tokens that are trained on
    cu_seqlens        [N+1] int, sequence boundaries; a sequence is never split across micro-batches

The objectives (`ppo_clip_token_losses`, `gspo_token_losses`, `cispo_token_losses`) return per-token
losses; `aggregate_token_losses` reduces per-token values to one number. An algorithm
(`archon.rl.algorithms`) puts the pieces together.

Aggregation (how per-token losses become one number):
    "token_mean"              sum_t l_t / (#response tokens in the batch)                (DAPO, CISPO)
    "seq_mean_token_mean"     sum_i (mean over y_i of l_t) / (#sequences in the batch)   (GRPO, GSPO)
    "seq_mean_token_sum_norm" sum_t l_t / (max_response_length * #sequences in batch)    (Dr.GRPO)
Sequences with no masked token are not counted in #sequences.

Normalisation across micro-batches (the contract the trainer's train_step relies on):
    The loss of one call is that micro-batch's *share* of the loss of the whole batch: the
    numerator is summed over this micro-batch only and divided by the count for the whole (global)
    batch, which the trainer passes in its `LossContext` (counted over all micro-batches and all
    data-parallel ranks). Then
        sum of the returned losses over micro-batches and ranks == the loss of the whole batch,
    so gradients are *summed* over micro-batches. `aggregation_normalizer` is the one place that
    says which count an aggregation divides by; `LossContext.for_batch` gives the counts of a batch
    scored in one piece.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from archon.trainer import LossContext

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
ImportanceSampling = Literal["none", "token", "sequence"]

# Log-ratios are clamped before exp() so one wild token cannot make the loss inf or NaN.
MAX_LOG_RATIO = 20.0


def sequence_index(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cu_seqlens [N+1] -> [T] long: the sequence each packed token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return ids.repeat_interleave(lengths, output_size=num_tokens)


def _as_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where() rather than a product: an inf on a masked-out token would turn 0 * inf into NaN.
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached fp32 mean of `values` [T] over the true positions of `mask` [T] (0 when none)."""
    mask = _as_mask(mask)
    return _masked_sum(values.detach().float(), mask) / mask.sum().clamp(min=1)


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if not bool(mask.any()):
        return values.new_zeros(())
    return values.detach()[mask].max().float()


def _per_sequence_sums(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] -> [N]: sum of the masked values of each sequence (differentiable)."""
    seq = sequence_index(cu_seqlens, values.numel())
    masked = torch.where(mask, values, torch.zeros_like(values))
    return torch.zeros(cu_seqlens.numel() - 1, dtype=values.dtype, device=values.device).index_add(0, seq, masked)


# ---- aggregation ---------------------------------------------------------------------------------


def aggregation_normalizer(aggregation: Aggregation, ctx: LossContext) -> torch.Tensor:
    """The whole-batch count that `aggregation` divides by (0-dim fp32): loss tokens for
    token_mean, sequences with at least one loss token for the seq_mean modes."""
    if aggregation == "token_mean":
        return ctx.global_tokens
    if aggregation in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        return ctx.global_sequences
    raise ValueError(
        f"unknown aggregation {aggregation!r}; expected token_mean, seq_mean_token_mean or seq_mean_token_sum_norm"
    )


def aggregate_token_losses(
    token_losses: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    aggregation: Aggregation,
    ctx: LossContext,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses [T] to this micro-batch's share of the batch loss (see the module doc).

    ctx: the whole batch's counts. max_response_length: the constant length divisor, required for
    "seq_mean_token_sum_norm".
    """
    mask = _as_mask(loss_mask)
    normalizer = aggregation_normalizer(aggregation, ctx)
    normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=token_losses.device)
    # An empty batch has a zero numerator; dividing by 1 keeps the loss 0 and backward() working.
    normalizer = torch.where(normalizer > 0, normalizer, torch.ones_like(normalizer))
    token_losses = token_losses.float()
    if aggregation == "token_mean":
        return _masked_sum(token_losses, mask) / normalizer
    if aggregation == "seq_mean_token_mean":
        sums = _per_sequence_sums(token_losses, mask, cu_seqlens)
        counts = _per_sequence_sums(mask.float(), mask, cu_seqlens)
        return (sums / counts.clamp(min=1)).sum() / normalizer
    if max_response_length is None or max_response_length <= 0:
        raise ValueError("aggregation 'seq_mean_token_sum_norm' needs a positive max_response_length")
    return _masked_sum(token_losses, mask) / (normalizer * max_response_length)


# ---- objectives ----------------------------------------------------------------------------------
# Each returns (token losses [T] fp32, clipped [T] bool, extra metrics). `clipped` marks the tokens
# whose ratio (or weight) the clip range changed; it feeds the clip_fraction metric.


def ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor) -> dict[str, torch.Tensor]:
    """clip_fraction, approx_kl (k3 estimate of KL(pi_old || pi_theta)), ratio_mean, ratio_max and
    num_tokens over the masked tokens."""
    log_ratio = log_ratio.detach().float().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    return {
        "clip_fraction": masked_mean(clipped.float(), mask),
        "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": _masked_max(ratio, mask),
        "num_tokens": mask.sum().float(),
    }


def ppo_clip_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token, r = pi_theta / pi_old:
        l_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    and with dual clip (clip_ratio_c = c > 1), for A < 0 only:
        l_t = min(max(-A r, -A clip(r, ...)), -A c)
    which bounds the loss of a negative-advantage token whose ratio has run past c (its gradient
    is then 0). Extra metric with dual clip: dual_clip_fraction (tokens with A < 0 and r > c).
    """
    log_ratio = (logprobs.float() - old_logprobs.float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    advantages = advantages.float()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    losses = -torch.minimum(unclipped, clipped)
    extra: dict[str, torch.Tensor] = {}
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (losses > bound)
        losses = torch.where(advantages < 0, torch.minimum(losses, bound), losses)
        extra["dual_clip_fraction"] = masked_mean(dual.float(), _as_mask(loss_mask))
    return losses, clipped < unclipped, extra


def gspo_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the sequence-level ratio s_i = exp(mean over y_i of log r_t), clipped with a small range.

    Applied per token in the paper's GSPO-token form: s_i,t = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t)).
    Its value is s_i on every token of sequence i and its gradient is s_i * grad log pi_theta(y_t); with
    one advantage per sequence and the seq_mean_token_mean aggregation this is exactly GSPO's gradient.
    Clipping is therefore decided per sequence. Extra metric: seq_ratio_mean.
    """
    mask = _as_mask(loss_mask)
    logprobs32 = logprobs.float()
    log_ratio = logprobs32 - old_logprobs.float()
    seq_sums = _per_sequence_sums(log_ratio.detach(), mask, cu_seqlens)
    seq_counts = _per_sequence_sums(mask.float(), mask, cu_seqlens)
    seq_log_ratio = (seq_sums / seq_counts.clamp(min=1)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seq = sequence_index(cu_seqlens, logprobs.numel())
    token_ratio = torch.exp(seq_log_ratio[seq] + logprobs32 - logprobs32.detach())
    adv = advantages.float()
    unclipped = token_ratio * adv
    clipped_term = token_ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    nonempty = seq_counts > 0
    seq_ratio_mean = seq_log_ratio[nonempty].exp().mean() if bool(nonempty.any()) else seq_log_ratio.new_ones(())
    return -torch.minimum(unclipped, clipped_term), clipped_term < unclipped, {"seq_ratio_mean": seq_ratio_mean}


def cispo_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: l_t = -sg(clip(r_t, 1-clip_low, 1+clip_high)) * A_t * log pi_theta(y_t).

    Only the importance weight is clipped (and detached), so every token keeps a gradient of
    -w_t * A_t. The paper sets no lower bound: clip_low=1.0 makes the bound 0, which a ratio never
    goes below; clip_high=4.0 caps the weight at 5 (ScaleRL's epsilon_max=5).
    """
    logprobs32 = logprobs.float()
    log_ratio = (logprobs32 - old_logprobs.float()).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages.float() * logprobs32, weight != ratio, {}


def check_inputs(logprobs, old_logprobs, advantages, loss_mask, cu_seqlens) -> None:
    """Shapes of a loss call's inputs; a ValueError names the tensor at fault."""
    shape = logprobs.shape
    if logprobs.ndim != 1:
        raise ValueError(f"logprobs must be packed 1-D [T], got shape {tuple(shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("loss_mask", loss_mask)):
        if t is None:
            raise ValueError(f"{name} is missing: the policy loss needs it for every token")
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")


# ---- KL penalty ----------------------------------------------------------------------------------


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3", cap: float | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.  [T], [T] -> [T] fp32.

    With d = log pi_ref - log pi_theta: k1 = -d, k2 = d^2 / 2, k3 = e^d - 1 - d. k3 is unbiased and
    never negative; d is clamped to +-20 inside k3 so a single token cannot overflow it, and `cap`
    (k3 only) clamps each token's value to at most cap, so one far-off token neither dominates the
    penalty nor gets a gradient from it.
    """
    delta = ref_logprobs.float().detach() - logprobs.float()
    if cap is not None and estimator != "k3":
        raise ValueError(f"a KL cap applies to the k3 estimator, not {estimator!r}")
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        delta = delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        k3 = delta.exp() - 1.0 - delta
        return k3 if cap is None else k3.clamp(max=cap)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


# ---- off-policy corrections: importance weights and IcePop ---------------------------------------


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    level: Literal["token", "sequence"],
    cap: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights pi_old / mu (proximal over behaviour policy), detached.  -> [T] fp32.

    token:    w_t = min(pi_old(y_t) / mu(y_t), cap)
    sequence: w_i = min(exp(sum over the masked tokens of y_i of log pi_old - log mu), cap), the same
              weight on every token of sequence i
    Multiplying the per-token losses by them corrects for the tokens having been sampled by mu (an
    older adapter, or the rollout engine's numerics). Log-ratios are clamped to +-20 before exp().
    Metrics over the masked tokens: tis_weight_mean, tis_clip_fraction (tokens whose weight was
    capped) and rollout_logprob_abs_diff (mean |log pi_old - log mu|).
    """
    if old_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"shape mismatch: old {tuple(old_logprobs.shape)} vs rollout {tuple(rollout_logprobs.shape)}")
    mask = _as_mask(loss_mask)
    token_log_ratio = (old_logprobs.float() - rollout_logprobs.float()).detach()
    if level == "token":
        log_ratio = token_log_ratio
    elif level == "sequence":
        seq_log_ratio = _per_sequence_sums(token_log_ratio, mask, cu_seqlens)
        log_ratio = seq_log_ratio[sequence_index(cu_seqlens, old_logprobs.numel())]
    else:
        raise ValueError(f"unknown importance-sampling level {level!r}; expected token or sequence")
    raw = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    weights = raw.clamp(max=cap)
    metrics = {
        "tis_weight_mean": masked_mean(weights, mask),
        "tis_clip_fraction": masked_mean((raw > cap).float(), mask),
        "rollout_logprob_abs_diff": masked_mean(token_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).abs(), mask),
    }
    return weights, metrics


def icepop_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IcePop importance weights, detached.  -> [T] fp32.

        w_t = pi_old(y_t) / mu(y_t)   if low <= pi_old(y_t) / mu(y_t) <= high
        w_t = 0                       otherwise
    A token-level importance weight whose band replaces the truncation of `importance_weights`:
    a token inside the band keeps its whole ratio (none is capped), and a token outside it is left
    out of the policy loss (loss and gradient 0), because the trainer and the sampler disagree on it
    too much for a weight to fix. Metrics over the masked tokens: tis_weight_mean,
    icepop_masked_fraction (the share of tokens outside the band) and rollout_logprob_abs_diff."""
    if old_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"shape mismatch: old {tuple(old_logprobs.shape)} vs rollout {tuple(rollout_logprobs.shape)}")
    mask = _as_mask(loss_mask)
    log_ratio = (old_logprobs.float() - rollout_logprobs.float()).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    keep = (ratio >= low) & (ratio <= high)
    weights = torch.where(keep, ratio, torch.zeros_like(ratio))
    metrics = {
        "tis_weight_mean": masked_mean(weights, mask),
        "icepop_masked_fraction": masked_mean((~keep).float(), mask),
        "rollout_logprob_abs_diff": masked_mean(log_ratio.abs(), mask),
    }
    return weights, metrics
