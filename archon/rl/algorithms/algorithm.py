"""`Algorithm`: a registered algorithm with its settings resolved against the run's config, which
turns a batch's rewards into advantages before training and is the trainer's loss function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from archon.rl.algorithms.advantages import (
    BatchSum,
    distillation_advantages,
    groups_with_reward_variance,
    mixed_distillation_advantages,
    overlong_penalty,
)
from archon.rl.algorithms.config import (
    AlgorithmConfig,
    distills,
    icepop_problem,
    importance_sampling_for,
    uses_reward_advantages,
)
from archon.rl.algorithms.losses import (
    Aggregation,
    aggregate_token_losses,
    check_inputs,
    icepop_weights,
    importance_weights,
    kl_penalty,
    masked_mean,
    ratio_metrics,
)
from archon.rl.algorithms.registry import ALGORITHMS, unknown_algorithm

if TYPE_CHECKING:
    from archon.batch import PackedBatch
    from archon.trainer import LossContext


@dataclass
class PreparedRewards:
    """A rollout batch's rewards turned into what training needs; per-sample tensors [N]."""

    rewards: torch.Tensor
    """The rewards after shaping (the overlong penalty added); the ones to log."""
    advantages: torch.Tensor
    """fp32 per-sample advantages (all 0 when dynamic sampling found no group to keep)."""
    keep: torch.Tensor
    """bool: the samples to train on (dynamic sampling drops groups whose rewards are all equal)."""


class Algorithm:
    """A registered algorithm with its settings resolved against the run's config."""

    def __init__(self, config: AlgorithmConfig, max_new_tokens: int, max_staleness: int = 0) -> None:
        loss = config.loss
        if config.name not in ALGORITHMS:
            raise ValueError(unknown_algorithm(config.name))
        self.name = config.name
        self.spec = ALGORITHMS[self.name]
        self.config = config
        self.loss_config = loss
        self.max_new_tokens = max_new_tokens
        self.clip_low = self.spec.clip_low if loss.clip_low is None else loss.clip_low
        self.clip_high = self.spec.clip_high if loss.clip_high is None else loss.clip_high
        self.aggregation: Aggregation = loss.aggregation or self.spec.aggregation
        self.max_response_length = loss.max_response_length or max_new_tokens
        """The Dr.GRPO length divisor: the generation limit unless set."""
        self.importance_sampling = importance_sampling_for(loss, max_staleness)
        if (problem := icepop_problem(loss)) is not None:
            raise ValueError(problem)

    @property
    def needs_reference(self) -> bool:
        """The loss wants batch.ref_logprobs, the log-probs of the adapter-off policy (KL penalty)."""
        return self.loss_config.kl_coef > 0

    @property
    def needs_teacher(self) -> bool:
        """The token advantages come (at least in part) from a teacher's log-probs."""
        return distills(self.config)

    @property
    def uses_reward_advantages(self) -> bool:
        """The token advantages include the rewards' (all but on-policy distillation alone)."""
        return uses_reward_advantages(self.config)

    # ---- before training: rewards -> advantages ---------------------------------------------------
    def prepare(
        self, rewards: torch.Tensor, lengths: torch.Tensor, group_size: int, batch_sum: BatchSum | None = None
    ) -> PreparedRewards:
        """rewards [N], response lengths [N] (samples stored group by group, the lengths counted in
        loss tokens) -> shaped rewards, advantages and the samples to keep. batch_sum sums per-rank
        totals over the data-parallel ranks, for estimators that whiten over the whole batch (None:
        this rank is the batch); it is called on every rank, whatever the rank keeps. The batch
        statistics count only the kept samples, each once per loss token (or once, with
        loss.advantage_whitening = response). Without reward advantages (on-policy distillation
        alone) the advantages are 0."""
        config = self.config
        if config.overlong_buffer:
            rewards = rewards + overlong_penalty(
                lengths, self.max_new_tokens, config.overlong_buffer, config.overlong_penalty_factor
            )
        keep = torch.ones(rewards.numel(), dtype=torch.bool)
        if config.dynamic_sampling:
            keep = groups_with_reward_variance(rewards, group_size).repeat_interleave(group_size)
        counts = lengths.float() if self.loss_config.advantage_whitening == "token" else torch.ones(rewards.numel())
        if self.uses_reward_advantages:
            advantages = self.spec.advantages(rewards, counts * keep, group_size, batch_sum)
        else:
            advantages = torch.zeros(rewards.numel())
        if not keep.any():  # nothing to learn from here; train on the step with zero advantages
            keep[:] = True
            advantages = torch.zeros_like(advantages)
        return PreparedRewards(rewards, advantages, keep)

    def token_advantages(
        self,
        task_advantages: torch.Tensor,
        student_logprobs: torch.Tensor,
        teacher_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
    ) -> torch.Tensor:
        """On-policy distillation's per-token advantages [T], 0 outside loss_mask: the teacher's
        alone (-(log pi_student - log pi_teacher)) without algorithm.distillation_weight, else
        the task advantage plus distillation_weight times it: one advantage per token, which the
        objective clips as one surrogate (see `mixed_distillation_advantages`)."""
        weight = self.config.distillation_weight
        if weight is None:
            return distillation_advantages(student_logprobs, teacher_logprobs) * loss_mask
        return mixed_distillation_advantages(task_advantages, student_logprobs, teacher_logprobs, weight) * loss_mask

    # ---- training: the loss (a trainer LossFn) --------------------------------------------------
    def loss(
        self, batch: PackedBatch, logprobs: torch.Tensor, ctx: LossContext
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the batch loss (see archon.rl.algorithms.losses) and its metrics:

            objective (clipped per the algorithm), times the importance weights (truncated, or
            IcePop's), aggregated; + kl_coef * KL penalty; - entropy_coef * entropy; all with one aggregation.

        Reads batch.old_logprobs and batch.advantages, batch.ref_logprobs with kl_coef > 0 and
        batch.rollout_logprobs with importance sampling or IcePop; ctx.entropy (the `entropy`
        metric, and the bonus). Metrics: policy_loss, clip_fraction, approx_kl, ratio_mean,
        ratio_max, num_tokens, the objective's own, tis_* / icepop_masked_fraction when enabled,
        kl / kl_loss, entropy, entropy_bonus, and loss.
        """
        config = self.loss_config
        old, mask, cu_seqlens = batch.old_logprobs, batch.loss_mask.bool(), batch.cu_seqlens
        check_inputs(logprobs, old, batch.advantages, mask, cu_seqlens)
        dual_clip = {} if config.clip_ratio_c is None else {"clip_ratio_c": config.clip_ratio_c}
        token_losses, clipped, extra = self.spec.objective(
            logprobs,
            old,
            batch.advantages,
            mask,
            cu_seqlens,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            **dual_clip,
        )
        metrics = ratio_metrics(logprobs - old, mask, clipped)
        metrics.update(extra)
        if self.importance_sampling != "none" or config.icepop_band is not None:
            if batch.rollout_logprobs is None:
                raise ValueError(
                    "importance_sampling or icepop_band is set but the batch has no rollout_logprobs (the "
                    "behaviour policy's log-probs)"
                )
        if config.icepop_band is not None:
            low, high = config.icepop_band
            weights, is_metrics = icepop_weights(old, batch.rollout_logprobs, mask, low, high)
            # where() rather than the product alone: a token outside the band with an inf loss would give NaN
            token_losses = torch.where(weights > 0, token_losses * weights, torch.zeros_like(token_losses))
            metrics.update(is_metrics)
        elif self.importance_sampling != "none":
            weights, is_metrics = importance_weights(
                old, batch.rollout_logprobs, mask, cu_seqlens, self.importance_sampling, config.importance_cap
            )
            token_losses = token_losses * weights
            metrics.update(is_metrics)
        loss = self._aggregate(token_losses, mask, cu_seqlens, ctx)
        metrics["policy_loss"] = loss.detach()
        if self.needs_reference:
            if batch.ref_logprobs is None:
                raise ValueError("kl_coef > 0 but the batch has no ref_logprobs")
            per_token = kl_penalty(logprobs, batch.ref_logprobs, config.kl_estimator, config.kl_cap)
            kl = self._aggregate(per_token, mask, cu_seqlens, ctx)
            loss = loss + config.kl_coef * kl
            metrics.update(kl=masked_mean(per_token, mask), kl_loss=kl.detach())
        if ctx.entropy is not None:
            metrics["entropy"] = masked_mean(ctx.entropy, mask)
        if config.entropy_coef > 0:
            if ctx.entropy is None:
                raise ValueError("entropy_coef > 0 needs the per-token entropy: train with with_entropy=True")
            bonus = self._aggregate(ctx.entropy, mask, cu_seqlens, ctx)
            loss = loss - config.entropy_coef * bonus
            metrics["entropy_bonus"] = bonus.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics

    def _aggregate(self, values, mask, cu_seqlens, ctx) -> torch.Tensor:
        return aggregate_token_losses(values, mask, cu_seqlens, self.aggregation, ctx, self.max_response_length)


def get_algorithm(config: AlgorithmConfig, max_new_tokens: int, max_staleness: int = 0) -> Algorithm:
    """The algorithm named by config.name, its defaults resolved; max_new_tokens is the
    generation limit (the overlong penalty's length, the default Dr.GRPO divisor), max_staleness the
    rollouts' staleness bound (the default importance sampling). An unknown name is a ValueError
    that lists the registered ones."""
    return Algorithm(config, max_new_tokens, max_staleness)
