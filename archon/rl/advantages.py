"""archon.rl.advantages, at its old path for one release: see archon.rl.algorithms.advantages."""

from archon.rl.algorithms.advantages import (  # noqa: F401 - at its old path for one release
    BatchSum,
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
