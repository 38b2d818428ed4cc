"""RL algorithms: one `Algorithm` per name, from a registry.

An algorithm is its advantage estimator, its policy objective and that objective's defaults (clip
range, aggregation); around them every algorithm shares the batch filters (DAPO's overlong penalty
and dynamic sampling), on-policy distillation, the KL penalty, the entropy bonus and the off-policy
corrections (importance weights, IcePop). The loop asks the `Algorithm` for each of these and names
no algorithm itself. Adding an algorithm is adding one entry to `ALGORITHMS`.

Use:
    algorithm = get_algorithm(config.algorithm, max_new_tokens=config.rollout.max_new_tokens)
    prepared = algorithm.prepare(rewards, lengths, group_size)   # advantages, keep, shaped rewards
    batch.advantages = algorithm.token_advantages(...)           # only with a teacher
    trainer.train_step(batch, algorithm.loss, ...)                # algorithm.loss is a LossFn
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from archon.rl.advantages import (
    BatchSum,
    distillation_advantages,
    drgrpo_advantages,
    groups_with_reward_variance,
    grpo_advantages,
    mixed_distillation_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)
from archon.rl.losses import (
    Aggregation,
    ImportanceSampling,
    KLEstimator,
    aggregate_token_losses,
    check_inputs,
    cispo_token_losses,
    gspo_token_losses,
    icepop_weights,
    importance_weights,
    kl_penalty,
    masked_mean,
    ppo_clip_token_losses,
    ratio_metrics,
)

if TYPE_CHECKING:
    from archon.batch import PackedBatch
    from archon.rl.config import AlgorithmConfig
    from archon.trainer import LossContext

AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor, int, "BatchSum | None"], torch.Tensor]
"""(rewards [B], weights [B], group_size, batch_sum) -> advantages [B] fp32. weights: how many times each
sample counts in statistics over the whole batch (see `reinforce_pp_advantages`); batch_sum sums
over data-parallel ranks."""
Objective = Callable[..., "tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]"]
"""(logprobs, old_logprobs, advantages, loss_mask, cu_seqlens, *, clip_low, clip_high) -> (token
losses [T], clipped [T], extra metrics); see archon.rl.losses."""


@dataclass(frozen=True)
class AlgorithmSpec:
    """A registry entry: what makes one algorithm differ from another."""

    summary: str
    advantages: AdvantageEstimator
    objective: Objective
    clip_low: float
    """Default lower clip (ratio, or CISPO weight, kept >= 1 - clip_low)."""
    clip_high: float
    """Default upper clip (ratio, or CISPO weight, kept <= 1 + clip_high)."""
    aggregation: Aggregation
    """Default aggregation of per-token losses."""
    group_of_one: str | None
    """Why the algorithm cannot learn from groups of one sample (rollout.group_size = 1); None: it can."""
    batch_whitened: bool = False
    """The advantages are whitened over the whole batch (loss.advantage_whitening says over what)."""
    dual_clip: bool = True
    """The objective is the token-level PPO clip, which loss.clip_ratio_c (dual clip) bounds."""


GROUP_NORMALISED = (
    "normalises each reward within its prompt's group, so with one sample per prompt every advantage is 0"
)

ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(
        "GRPO: group-normalised advantages, PPO clip, mean over each response then over responses",
        advantages=lambda rewards, weights, group_size, batch_sum: grpo_advantages(rewards, group_size),
        objective=ppo_clip_token_losses,
        clip_low=0.2,
        clip_high=0.2,
        aggregation="seq_mean_token_mean",
        group_of_one=GROUP_NORMALISED,
    ),
    "drgrpo": AlgorithmSpec(
        "Dr.GRPO: group-centred advantages (no std), token sums divided by a constant length",
        advantages=lambda rewards, weights, group_size, batch_sum: drgrpo_advantages(rewards, group_size),
        objective=ppo_clip_token_losses,
        clip_low=0.2,
        clip_high=0.2,
        aggregation="seq_mean_token_sum_norm",
        group_of_one="subtracts its group's mean from each reward, so with one sample per prompt every advantage is 0",
    ),
    "dapo": AlgorithmSpec(
        "DAPO: GRPO advantages, clip-higher (1 - 0.2, 1 + 0.28), token mean over the batch",
        advantages=lambda rewards, weights, group_size, batch_sum: grpo_advantages(rewards, group_size),
        objective=ppo_clip_token_losses,
        clip_low=0.2,
        clip_high=0.28,
        aggregation="token_mean",
        group_of_one=GROUP_NORMALISED,
    ),
    "gspo": AlgorithmSpec(
        "GSPO: GRPO advantages, sequence-level ratio clipped in a small range",
        advantages=lambda rewards, weights, group_size, batch_sum: grpo_advantages(rewards, group_size),
        objective=gspo_token_losses,
        clip_low=3e-4,
        clip_high=4e-4,
        aggregation="seq_mean_token_mean",
        group_of_one=GROUP_NORMALISED,
        dual_clip=False,
    ),
    "cispo": AlgorithmSpec(
        "CISPO: GRPO advantages, clipped and detached importance weight on every token's log-prob",
        advantages=lambda rewards, weights, group_size, batch_sum: grpo_advantages(rewards, group_size),
        objective=cispo_token_losses,
        clip_low=1.0,
        clip_high=4.0,
        aggregation="token_mean",
        group_of_one=GROUP_NORMALISED,
        dual_clip=False,
    ),
    "rloo": AlgorithmSpec(
        "RLOO: leave-one-out baseline within the group, PPO clip, token mean",
        advantages=lambda rewards, weights, group_size, batch_sum: rloo_advantages(rewards, group_size),
        objective=ppo_clip_token_losses,
        clip_low=0.2,
        clip_high=0.2,
        aggregation="token_mean",
        group_of_one="takes each sample's baseline from the other samples of its group, and a group of one has none",
    ),
    "reinforce_pp": AlgorithmSpec(
        "REINFORCE++: rewards whitened over the whole batch (no group baseline), PPO clip, token mean",
        advantages=lambda rewards, weights, group_size, batch_sum: reinforce_pp_advantages(
            rewards, group_size, group_baseline=False, weights=weights, batch_sum=batch_sum
        ),
        objective=ppo_clip_token_losses,
        clip_low=0.2,
        clip_high=0.2,
        aggregation="token_mean",
        group_of_one=None,
        batch_whitened=True,
    ),
    "reinforce_pp_baseline": AlgorithmSpec(
        "REINFORCE++-baseline: group mean subtracted (none for groups of one), then whitened over the whole "
        "batch; PPO clip, token mean",
        advantages=lambda rewards, weights, group_size, batch_sum: reinforce_pp_advantages(
            rewards, group_size, group_baseline=True, weights=weights, batch_sum=batch_sum
        ),
        objective=ppo_clip_token_losses,
        clip_low=0.2,
        clip_high=0.2,
        aggregation="token_mean",
        group_of_one=None,
        batch_whitened=True,
    ),
}

AlgorithmName = Literal[tuple(ALGORITHMS)]  # the registry's names, for the config's type checking and --help


def unknown_algorithm(name: str) -> str:
    return f"unknown algorithm {name!r}; registered algorithms: {', '.join(ALGORITHMS)}"


@dataclass
class LossConfig:
    """The settings of an algorithm's loss (the `algorithm.loss` section of the recipe config; the
    algorithm itself is `algorithm.name`). Every default leaves the algorithm as its paper defines it."""

    clip_low: float | None = None
    """Lower clip: the ratio (or CISPO weight) is kept >= 1 - clip_low. None: the algorithm's default."""
    clip_high: float | None = None
    """Upper clip: the ratio (or CISPO weight) is kept <= 1 + clip_high. None: the algorithm's default."""
    clip_ratio_c: float | None = None
    """Dual-clip PPO: for tokens with a negative advantage the loss is at most -A * clip_ratio_c, so a
    ratio far above 1 cannot blow the loss up (3.0 is the usual choice). Must be > 1; None disables
    it. Only for the PPO clipped objective (not gspo or cispo)."""
    aggregation: Aggregation | None = None
    """token_mean, seq_mean_token_mean or seq_mean_token_sum_norm. None: the algorithm's default."""
    max_response_length: int | None = None
    """Constant length divisor for seq_mean_token_sum_norm (Dr.GRPO). None: the generation limit,
    rollout.max_new_tokens."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against the reference policy (the model with its adapter off); 0 disables it."""
    kl_estimator: KLEstimator = "k3"
    kl_cap: float | None = None
    """Clamp each token's k3 KL value to at most this (needs kl_estimator k3 and kl_coef > 0); None: no cap."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef * the mean entropy of the response tokens,
    aggregated like the policy loss; 0 disables it."""
    importance_sampling: ImportanceSampling | None = None
    """Off-policy correction (the decoupled PPO objective): the PPO ratio is taken against pi_old,
    the trainer's score of the batch before the update, and each token's loss is multiplied by the
    truncated weight pi_old / mu for the behaviour policy mu that sampled it. token: a weight per
    token; sequence: one weight per response, exp(sum of its tokens' log-ratios). none: no weight.
    Default: token in the asynchronous mode (rollout.max_staleness >= 1), where mu is an older
    adapter, or with icepop_band; none otherwise. Needs algorithm.recompute_old_logprobs."""
    importance_cap: float = 2.0
    """Truncation C of the importance weights: w = min(ratio, C). Must be > 0. Not used with
    icepop_band, whose band replaces the truncation."""
    icepop_band: tuple[float, float] | None = None
    """IcePop, e.g. (0.5, 5.0): each token's loss is weighted by its ratio pi_old / mu when the ratio
    is inside [low, high], and the token is left out of the policy loss (weight 0, the metric
    icepop_masked_fraction counts it) when it is outside. It is token-level importance sampling
    with the band in place of the truncation, so importance_sampling must be token or unset (not
    sequence or none). Needs 0 < low <= 1 <= high and algorithm.recompute_old_logprobs. None
    disables it."""
    advantage_whitening: Literal["token", "response"] = "token"
    """reinforce_pp and reinforce_pp_baseline: what the batch mean and standard deviation of the
    advantages are taken over. token: every loss token, so each response counts once per token it
    has (the REINFORCE++ definition, as in verl); response: each response once."""

    def __post_init__(self) -> None:
        if self.max_response_length is not None and self.max_response_length <= 0:
            raise ValueError(f"LossConfig.max_response_length must be positive, got {self.max_response_length}")


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
        """This micro-batch's share of the batch loss (see archon.rl.losses) and its metrics:

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


def importance_sampling_for(loss: LossConfig, max_staleness: int) -> ImportanceSampling:
    """loss.importance_sampling, or its default: token when samples may come from an older adapter
    or with IcePop (a token-level weight)."""
    if loss.importance_sampling is not None:
        return loss.importance_sampling
    return "token" if max_staleness > 0 or loss.icepop_band is not None else "none"


def distills(config: AlgorithmConfig) -> bool:
    """On-policy distillation: a teacher (algorithm.teacher_path) or teachers per data source
    (algorithm.teachers) give the token advantages, at least in part."""
    return config.teacher_path is not None or bool(config.teachers)


def teacher_setting(config: AlgorithmConfig, data_source: str, where: str = "algorithm") -> tuple[str, str] | None:
    """(path, the setting that names it) of the teacher of the samples of rows with `data_source`:
    the entry of config.teachers for it, else the default teacher config.teacher_path; None when
    neither is set. `where` is the algorithm section's place (algorithm, or tasks[i].algorithm)."""
    for i, teacher in enumerate(config.teachers):
        if teacher.data_source == data_source:
            return teacher.path, f"{where}.teachers[{i}].path"
    if config.teacher_path is not None:
        return config.teacher_path, f"{where}.teacher_path"
    return None


def uses_reward_advantages(config: AlgorithmConfig) -> bool:
    """The token advantages include the rewards' advantages: always but with teachers alone
    (algorithm.teacher_path or algorithm.teachers set and algorithm.distillation_weight not)."""
    return not distills(config) or config.distillation_weight is not None


def group_size_problem(name: str, group_size: int) -> str | None:
    """Why algorithm `name` cannot learn from groups of `group_size` samples per prompt, or None.

    A group of one sample has no other sample to compare with: the group-normalised algorithms
    (grpo, drgrpo, dapo, gspo, cispo) would give every sample advantage 0 and rloo has no
    leave-one-out baseline, so these need groups of 2 or more. reinforce_pp whitens the rewards over
    the batch and reinforce_pp_baseline, with no group mean to subtract, does the same."""
    reason = ALGORITHMS[name].group_of_one
    if group_size != 1 or reason is None:
        return None
    single = ", ".join(n for n, spec in ALGORITHMS.items() if spec.group_of_one is None)
    return f"algorithm {name!r} {reason}; use groups of 2 or more, or an algorithm that learns from one ({single})"


def icepop_problem(loss: LossConfig, where: str = "algorithm") -> str | None:
    """Why loss.icepop_band cannot go with loss.importance_sampling, or None: IcePop weights each
    token by its own ratio, a token-level weight that a sequence-level weight would multiply twice
    and that 'none' would contradict."""
    if loss.icepop_band is None or loss.importance_sampling in (None, "token"):
        return None
    return (
        f"{where}.loss.importance_sampling={loss.importance_sampling!r}: IcePop ({where}.loss.icepop_band="
        f"{loss.icepop_band}) weights each token by its own ratio pi_old / mu inside the band, a token-level "
        "importance weight; set importance_sampling to 'token' or leave it unset"
    )


def algorithm_problems(config: AlgorithmConfig, group_size: int, where: str = "algorithm") -> list[str]:
    """What is wrong with the algorithm settings `config` (the field `where`: algorithm, or a task's
    tasks[i].algorithm) for groups of `group_size` samples per prompt, each as 'field=value: rule'."""
    loss = config.loss
    problems = []
    if uses_reward_advantages(config) and (problem := group_size_problem(config.name, group_size)) is not None:
        problems.append(f"rollout.group_size={group_size}: {where}.name={config.name!r}: {problem}")
    if config.dynamic_sampling and group_size == 1:
        problems.append(
            f"{where}.dynamic_sampling=True: keeps only the groups whose rewards differ, and with "
            "rollout.group_size=1 no group has two rewards to differ"
        )
    if (problem := icepop_problem(loss, where)) is not None:
        problems.append(problem)
    if loss.advantage_whitening != "token" and not ALGORITHMS[config.name].batch_whitened:
        whitened = ", ".join(n for n, spec in ALGORITHMS.items() if spec.batch_whitened)
        problems.append(
            f"{where}.loss.advantage_whitening={loss.advantage_whitening!r}: only algorithms that whiten their "
            f"advantages over the batch ({whitened}) use it, not {config.name!r}"
        )
    return problems


def get_algorithm(config: AlgorithmConfig, max_new_tokens: int, max_staleness: int = 0) -> Algorithm:
    """The algorithm named by config.name, its defaults resolved; max_new_tokens is the
    generation limit (the overlong penalty's length, the default Dr.GRPO divisor), max_staleness the
    rollouts' staleness bound (the default importance sampling). An unknown name is a ValueError
    that lists the registered ones."""
    return Algorithm(config, max_new_tokens, max_staleness)
