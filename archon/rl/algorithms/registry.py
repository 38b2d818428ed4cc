"""The algorithm registry: one `AlgorithmSpec` per name, what makes one algorithm differ from another
(its advantage estimator, its objective and that objective's defaults). Adding an algorithm is
adding one entry to `ALGORITHMS`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from archon.rl.algorithms.advantages import (
    BatchSum,
    drgrpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from archon.rl.algorithms.losses import (
    Aggregation,
    cispo_token_losses,
    gspo_token_losses,
    ppo_clip_token_losses,
)

AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor, int, "BatchSum | None"], torch.Tensor]
"""(rewards [B], weights [B], group_size, batch_sum) -> advantages [B] fp32. weights: how many times each
sample counts in statistics over the whole batch (see `reinforce_pp_advantages`); batch_sum sums
over data-parallel ranks."""
Objective = Callable[..., "tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]"]
"""(logprobs, old_logprobs, advantages, loss_mask, cu_seqlens, *, clip_low, clip_high) -> (token
losses [T], clipped [T], extra metrics); see archon.rl.algorithms.losses."""


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
