"""archon.rl.losses, at its old path for one release: see archon.rl.algorithms.losses."""

from archon.rl.algorithms.losses import (  # noqa: F401 - at its old path for one release
    MAX_LOG_RATIO,
    Aggregation,
    ImportanceSampling,
    KLEstimator,
    aggregate_token_losses,
    aggregation_normalizer,
    check_inputs,
    cispo_token_losses,
    gspo_token_losses,
    icepop_weights,
    importance_weights,
    kl_penalty,
    masked_mean,
    ppo_clip_token_losses,
    ratio_metrics,
    sequence_index,
)
