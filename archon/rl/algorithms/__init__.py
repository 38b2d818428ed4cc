"""RL algorithms: one `Algorithm` per name, from a registry.

An algorithm is its advantage estimator, its policy objective and that objective's defaults (clip
range, aggregation); around them every algorithm shares the batch filters (DAPO's overlong penalty
and dynamic sampling), on-policy distillation, the KL penalty, the entropy bonus and the off-policy
corrections (importance weights, IcePop). The loop asks the `Algorithm` for each of these and names
no algorithm itself. Adding an algorithm is adding one entry to `ALGORITHMS`.

    registry     AlgorithmSpec and ALGORITHMS, the registered names (AlgorithmName)
    config       the algorithm section (AlgorithmConfig, LossConfig, TeacherConfig) and its rules
    algorithm    Algorithm: rewards -> advantages, and the loss
    advantages   advantage estimators: pure functions on tensors
    losses       objectives, importance weights, KL, aggregation: pure functions on tensors

Use:
    algorithm = get_algorithm(config.algorithm, max_new_tokens=config.rollout.max_new_tokens)
    prepared = algorithm.prepare(rewards, lengths, group_size)   # advantages, keep, shaped rewards
    batch.advantages = algorithm.token_advantages(...)           # only with a teacher
    trainer.train_step(batch, algorithm.loss, ...)                # algorithm.loss is a LossFn
"""

from archon.rl.algorithms.advantages import (
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
from archon.rl.algorithms.algorithm import Algorithm, PreparedRewards, get_algorithm
from archon.rl.algorithms.config import (
    AlgorithmConfig,
    LossConfig,
    TeacherConfig,
    algorithm_problems,
    algorithm_section_problems,
    distills,
    group_size_problem,
    icepop_problem,
    importance_sampling_for,
    teacher_setting,
    uses_reward_advantages,
)
from archon.rl.algorithms.losses import (
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
from archon.rl.algorithms.registry import (
    ALGORITHMS,
    GROUP_NORMALISED,
    AdvantageEstimator,
    AlgorithmName,
    AlgorithmSpec,
    Objective,
    unknown_algorithm,
)

__all__ = [
    "ALGORITHMS",
    "GROUP_NORMALISED",
    "AdvantageEstimator",
    "Aggregation",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmName",
    "AlgorithmSpec",
    "BatchSum",
    "ImportanceSampling",
    "KLEstimator",
    "LossConfig",
    "Objective",
    "PreparedRewards",
    "TeacherConfig",
    "aggregate_token_losses",
    "algorithm_problems",
    "algorithm_section_problems",
    "check_inputs",
    "cispo_token_losses",
    "distillation_advantages",
    "distills",
    "drgrpo_advantages",
    "get_algorithm",
    "group_size_problem",
    "groups_with_reward_variance",
    "grpo_advantages",
    "gspo_token_losses",
    "icepop_problem",
    "icepop_weights",
    "importance_sampling_for",
    "importance_weights",
    "kl_penalty",
    "masked_mean",
    "mixed_distillation_advantages",
    "overlong_penalty",
    "ppo_clip_token_losses",
    "ratio_metrics",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "teacher_setting",
    "unknown_algorithm",
    "uses_reward_advantages",
]
