"""Policy losses for the GRPO family, over packed per-token tensors.

Inputs (all per-token tensors have shape [T], the packed layout of the model forward):
    logprobs          log pi_theta(y_t), with gradient
    old_logprobs      log pi_old(y_t), the policy that the advantages refer to (no gradient)
    advantages        per-token advantages; broadcast a per-sequence advantage with
                      `archon.rl.advantages.expand_to_tokens`
    loss_mask         bool or 0/1, true on the response tokens that are trained on
    cu_seqlens        [N+1] int, sequence boundaries; a sequence is never split across micro-batches

Every loss returns `(loss, metrics)`: a 0-dim fp32 tensor to call `backward()` on, and a dict of
detached 0-dim tensors (token means over this call's masked tokens, plus `num_tokens`, so the caller
can average them over micro-batches weighted by `num_tokens`).

Aggregation (how per-token losses become one number) is explicit and selectable:
    "token_mean"              sum_t l_t / (#response tokens in the batch)                (DAPO, CISPO)
    "seq_mean_token_mean"     sum_i (mean over y_i of l_t) / (#sequences in the batch)   (GRPO, GSPO)
    "seq_mean_token_sum_norm" sum_t l_t / (max_response_length * #sequences in batch)    (Dr.GRPO)
Sequences with no masked token are not counted in #sequences.

Normalisation across micro-batches (the contract train_step relies on):
    The loss of one call is that micro-batch's *share* of the loss of the whole batch: the
    numerator is summed over this micro-batch only and divided by `normalizer`, the count for the
    whole (global) batch. Compute each micro-batch's count with `loss_normalizer`, sum them over all
    micro-batches and all data-parallel ranks, and pass that sum to every call. Then
        sum of the returned losses over micro-batches and ranks == the loss of the whole batch,
    so gradients must be *summed* over micro-batches (plain accumulation, no division by the number
    of micro-batches). If the data-parallel gradient reduction averages over ranks (FSDP2's default),
    multiply each loss by the data-parallel world size or make the reduction a sum.
    With `normalizer=None` the micro-batch's own count is used: right only for a single micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
Algorithm = Literal["grpo", "drgrpo", "dapo", "gspo", "cispo"]
KLEstimator = Literal["k1", "k2", "k3"]

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


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
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


def loss_normalizer(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    """This micro-batch's contribution to the global normaliser (0-dim fp32 tensor).

    token_mean: the number of masked tokens. The two seq_mean modes: the number of sequences with at
    least one masked token. Sum it over micro-batches and data-parallel ranks (all_reduce SUM) and
    pass the total as `normalizer` to the loss functions.
    """
    mask = _as_mask(loss_mask)
    if aggregation == "token_mean":
        return mask.sum().float()
    if aggregation in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        tokens_per_seq = _per_sequence_sums(mask.float(), mask, cu_seqlens)
        return (tokens_per_seq > 0).sum().float()
    raise ValueError(f"unknown aggregation {aggregation!r}")


def aggregate_token_losses(
    token_losses: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    aggregation: Aggregation,
    normalizer: torch.Tensor | float | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses [T] to this micro-batch's share of the batch loss (see the module doc).

    normalizer: the global count from `loss_normalizer` summed over the whole batch; None means
    this micro-batch's own count. max_response_length: the constant length divisor, required for
    "seq_mean_token_sum_norm".
    """
    mask = _as_mask(loss_mask)
    if normalizer is None:
        normalizer = loss_normalizer(mask, cu_seqlens, aggregation)
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
    if aggregation == "seq_mean_token_sum_norm":
        if max_response_length is None or max_response_length <= 0:
            raise ValueError("aggregation 'seq_mean_token_sum_norm' needs a positive max_response_length")
        return _masked_sum(token_losses, mask) / (normalizer * max_response_length)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def _ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor) -> dict[str, torch.Tensor]:
    log_ratio = log_ratio.detach().float().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    return {
        "clip_fraction": _masked_mean(clipped.float(), mask),
        # k3 estimate of KL(pi_old || pi_theta) from the sampled tokens: (r - 1) - log r
        "approx_kl": _masked_mean((ratio - 1) - log_ratio, mask),
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_max": _masked_max(ratio, mask),
        "num_tokens": mask.sum().float(),
    }


def ppo_clip_token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate -min(r A, clip(r, 1-clip_low, 1+clip_high) A), r = pi_theta/pi_old.

    Returns (losses [T], clipped [T] bool), where clipped marks tokens on which the clipped branch
    is the smaller one, so they get no gradient.
    """
    log_ratio = (logprobs.float() - old_logprobs.float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    advantages = advantages.float()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def _check_inputs(logprobs, old_logprobs, advantages, loss_mask, cu_seqlens) -> None:
    shape = logprobs.shape
    if logprobs.ndim != 1:
        raise ValueError(f"logprobs must be packed 1-D [T], got shape {tuple(shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("loss_mask", loss_mask)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")


def _apply_tis(token_losses: torch.Tensor, tis_weights: torch.Tensor | None) -> torch.Tensor:
    return token_losses if tis_weights is None else token_losses * tis_weights.detach().float()


def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: Aggregation,
    normalizer: torch.Tensor | float | None = None,
    max_response_length: int | None = None,
    tis_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO clipped surrogate with asymmetric clip range and a chosen aggregation.

    grpo_loss, drgrpo_loss and dapo_loss are this with their papers' settings. tis_weights [T]
    (see `truncated_importance_weights`) multiply the per-token losses.
    """
    _check_inputs(logprobs, old_logprobs, advantages, loss_mask, cu_seqlens)
    mask = _as_mask(loss_mask)
    token_losses, clipped = ppo_clip_token_losses(logprobs, old_logprobs, advantages, clip_low, clip_high)
    loss = aggregate_token_losses(
        _apply_tis(token_losses, tis_weights), mask, cu_seqlens, aggregation, normalizer, max_response_length
    )
    metrics = _ratio_metrics(logprobs - old_logprobs, mask, clipped)
    metrics["policy_loss"] = loss.detach()
    return loss, metrics


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    aggregation: Aggregation = "seq_mean_token_mean",
    normalizer: torch.Tensor | float | None = None,
    max_response_length: int | None = None,
    tis_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO: symmetric clip eps, mean over each response's tokens, then mean over responses."""
    return clipped_surrogate_loss(
        logprobs, old_logprobs, advantages, loss_mask, cu_seqlens,
        clip_low=clip_eps, clip_high=clip_eps, aggregation=aggregation, normalizer=normalizer,
        max_response_length=max_response_length, tis_weights=tis_weights,
    )  # fmt: skip


def drgrpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_response_length: int,
    clip_eps: float = 0.2,
    aggregation: Aggregation = "seq_mean_token_sum_norm",
    normalizer: torch.Tensor | float | None = None,
    tis_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dr.GRPO: each response's token sum divided by the constant max_response_length (not |y_i|)."""
    return clipped_surrogate_loss(
        logprobs, old_logprobs, advantages, loss_mask, cu_seqlens,
        clip_low=clip_eps, clip_high=clip_eps, aggregation=aggregation, normalizer=normalizer,
        max_response_length=max_response_length, tis_weights=tis_weights,
    )  # fmt: skip


def dapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    aggregation: Aggregation = "token_mean",
    normalizer: torch.Tensor | float | None = None,
    max_response_length: int | None = None,
    tis_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO: clip-higher (ratio in [1-0.2, 1+0.28]) and a token-level mean over the whole batch."""
    return clipped_surrogate_loss(
        logprobs, old_logprobs, advantages, loss_mask, cu_seqlens,
        clip_low=clip_low, clip_high=clip_high, aggregation=aggregation, normalizer=normalizer,
        max_response_length=max_response_length, tis_weights=tis_weights,
    )  # fmt: skip


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    aggregation: Aggregation = "seq_mean_token_mean",
    normalizer: torch.Tensor | float | None = None,
    max_response_length: int | None = None,
    tis_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the sequence-level ratio s_i = exp(mean over y_i of log r_t), clipped with a small range.

    Applied per token in the paper's GSPO-token form: s_i,t = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t)).
    Its value is s_i on every token of sequence i and its gradient is s_i * grad log pi_theta(y_t); with
    one advantage per sequence and the seq_mean_token_mean aggregation this is exactly GSPO's gradient.
    Clipping is therefore decided per sequence. Extra metric: seq_ratio_mean.
    """
    _check_inputs(logprobs, old_logprobs, advantages, loss_mask, cu_seqlens)
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
    token_losses = -torch.minimum(unclipped, clipped_term)
    loss = aggregate_token_losses(
        _apply_tis(token_losses, tis_weights), mask, cu_seqlens, aggregation, normalizer, max_response_length
    )
    metrics = _ratio_metrics(log_ratio, mask, clipped_term < unclipped)
    nonempty = seq_counts > 0
    metrics["seq_ratio_mean"] = (
        seq_log_ratio[nonempty].exp().mean() if bool(nonempty.any()) else seq_log_ratio.new_ones(())
    )
    metrics["policy_loss"] = loss.detach()
    return loss, metrics


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 4.0,
    aggregation: Aggregation = "token_mean",
    normalizer: torch.Tensor | float | None = None,
    max_response_length: int | None = None,
    tis_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: -sum_t sg(clip(r_t, 1-clip_low, 1+clip_high)) * A_t * log pi_theta(y_t) / N_tokens.

    Only the importance weight is clipped (and detached), so every token keeps a gradient of
    -w_t * A_t / N. The paper sets no lower bound: clip_low=1.0 makes the bound 0, which a ratio never
    goes below. clip_high=4.0 caps the weight at 5, the ScaleRL epsilon_max=5 that TRL documents
    (TRL applies it directly as the cap).
    """
    _check_inputs(logprobs, old_logprobs, advantages, loss_mask, cu_seqlens)
    mask = _as_mask(loss_mask)
    logprobs32 = logprobs.float()
    log_ratio = (logprobs32 - old_logprobs.float()).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_losses = -weight * advantages.float() * logprobs32
    loss = aggregate_token_losses(
        _apply_tis(token_losses, tis_weights), mask, cu_seqlens, aggregation, normalizer, max_response_length
    )
    metrics = _ratio_metrics(log_ratio, mask, weight != ratio)
    metrics["policy_loss"] = loss.detach()
    return loss, metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.  [T], [T] -> [T] fp32.

    With d = log pi_ref - log pi_theta: k1 = -d, k2 = d^2 / 2, k3 = e^d - 1 - d. k3 is unbiased and
    never negative; d is clamped to +-20 inside k3 so a single token cannot overflow it.
    """
    delta = ref_logprobs.float().detach() - logprobs.float()
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        delta = delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return delta.exp() - 1.0 - delta
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    estimator: KLEstimator = "k3",
    aggregation: Aggregation = "token_mean",
    normalizer: torch.Tensor | float | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KL penalty term, aggregated like the policy loss (use the same aggregation and normaliser).

    The full objective is policy_loss + kl_coef * kl_loss. Metric: kl (token mean).
    """
    mask = _as_mask(loss_mask)
    per_token = kl_penalty(logprobs, ref_logprobs, estimator)
    loss = aggregate_token_losses(per_token, mask, cu_seqlens, aggregation, normalizer, max_response_length)
    return loss, {"kl": _masked_mean(per_token, mask), "kl_loss": loss.detach()}


def truncated_importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    cap: float = 2.0,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TIS: per-token weights min(pi_old / mu, cap), detached, where mu is the rollout engine's policy.

    They correct for the trainer/rollout log-prob mismatch; pass them as `tis_weights` to a policy
    loss. Returns (weights [T] fp32, metrics over the masked tokens — all tokens without a mask):
    tis_weight_mean, tis_clip_fraction and rollout_logprob_abs_diff (mean |log pi_old - log mu|).
    """
    if old_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"shape mismatch: old {tuple(old_logprobs.shape)} vs rollout {tuple(rollout_logprobs.shape)}")
    mask = torch.ones_like(old_logprobs, dtype=torch.bool) if loss_mask is None else _as_mask(loss_mask)
    log_ratio = (old_logprobs.float() - rollout_logprobs.float()).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    raw = log_ratio.exp()
    weights = raw.clamp(max=cap)
    metrics = {
        "tis_weight_mean": _masked_mean(weights, mask),
        "tis_clip_fraction": _masked_mean((raw > cap).float(), mask),
        "rollout_logprob_abs_diff": _masked_mean(log_ratio.abs(), mask),
    }
    return weights, metrics


@dataclass
class LossConfig:
    """Which policy loss to use and its settings (the `algorithm` section of the recipe config)."""

    algorithm: Algorithm = "grpo"
    """grpo, drgrpo, dapo, gspo or cispo."""
    clip_low: float | None = None
    """Lower clip: the ratio (or CISPO weight) is kept >= 1 - clip_low. None: the algorithm's default."""
    clip_high: float | None = None
    """Upper clip: the ratio (or CISPO weight) is kept <= 1 + clip_high. None: the algorithm's default."""
    aggregation: Aggregation | None = None
    """token_mean, seq_mean_token_mean or seq_mean_token_sum_norm. None: the algorithm's default."""
    max_response_length: int | None = None
    """Constant length divisor for seq_mean_token_sum_norm (Dr.GRPO). None: the generation limit,
    rollout.max_new_tokens (the RL recipe fills it in)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against the reference policy; 0 disables it."""
    kl_estimator: KLEstimator = "k3"
    tis_cap: float | None = None
    """Truncated importance sampling cap C (e.g. 2.0); None disables TIS."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHM_DEFAULTS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; expected one of {', '.join(ALGORITHM_DEFAULTS)}")
        if self.max_response_length is not None and self.max_response_length <= 0:
            raise ValueError(f"LossConfig.max_response_length must be positive, got {self.max_response_length}")

    def for_rollout(self, max_new_tokens: int) -> "LossConfig":
        """This config with max_response_length set to the generation limit when it is unset."""
        if self.max_response_length is not None:
            return self
        return replace(self, max_response_length=max_new_tokens)

    def resolved_clip(self) -> tuple[float, float]:
        low, high, _ = ALGORITHM_DEFAULTS[self.algorithm]
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)

    def resolved_aggregation(self) -> Aggregation:
        return self.aggregation or ALGORITHM_DEFAULTS[self.algorithm][2]


# algorithm -> (clip_low, clip_high, aggregation)
ALGORITHM_DEFAULTS: dict[str, tuple[float, float, Aggregation]] = {
    "grpo": (0.2, 0.2, "seq_mean_token_mean"),
    "drgrpo": (0.2, 0.2, "seq_mean_token_sum_norm"),
    "dapo": (0.2, 0.28, "token_mean"),
    "gspo": (3e-4, 4e-4, "seq_mean_token_mean"),
    "cispo": (1.0, 4.0, "token_mean"),
}


def policy_loss(
    config: LossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    normalizer: torch.Tensor | float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The configured policy loss + kl_coef * KL penalty, with TIS when config.tis_cap is set.

    normalizer: `loss_normalizer(mask, cu_seqlens, config.resolved_aggregation())` summed over the
    whole batch (see the module doc). ref_logprobs [T] are required when kl_coef > 0 and
    rollout_logprobs [T] when tis_cap is set. Metrics: those of the policy loss, plus kl / kl_loss
    and the TIS metrics when enabled, and `loss`.
    """
    mask = _as_mask(loss_mask)
    clip_low, clip_high = config.resolved_clip()
    aggregation = config.resolved_aggregation()
    tis_weights = None
    tis_metrics: dict[str, torch.Tensor] = {}
    if config.tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap is set but no rollout_logprobs were given")
        tis_weights, tis_metrics = truncated_importance_weights(old_logprobs, rollout_logprobs, config.tis_cap, mask)
    loss_fn = {"gspo": gspo_loss, "cispo": cispo_loss}.get(config.algorithm, clipped_surrogate_loss)
    loss, metrics = loss_fn(
        logprobs, old_logprobs, advantages, mask, cu_seqlens,
        clip_low=clip_low, clip_high=clip_high, aggregation=aggregation, normalizer=normalizer,
        max_response_length=config.max_response_length, tis_weights=tis_weights,
    )  # fmt: skip
    metrics.update(tis_metrics)
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 but no ref_logprobs were given")
        kl, kl_metrics = kl_loss(
            logprobs, ref_logprobs, mask, cu_seqlens, estimator=config.kl_estimator, aggregation=aggregation,
            normalizer=normalizer, max_response_length=config.max_response_length,
        )  # fmt: skip
        loss = loss + config.kl_coef * kl
        metrics.update(kl_metrics)
    metrics["loss"] = loss.detach()
    return loss, metrics
