"""Rewards: a batch of completions -> a rewards tensor (see archon.rl.rewards.scorer for the time
limits and the failures).

    config    RewardConfig, RewardTermConfig: the reward section, and its rules
    scorer    RewardScorer: scores batches in worker processes (or in this process), term by term
    http      reward servers and LLM judges, as terms

The reward functions themselves and the worker process that runs them (archon.rl.reward_fns,
`python -m archon.rl.reward_worker`) live beside this package, not in it: a worker imports them
without importing this package's scorer, and so without torch.
"""

from archon.rl.rewards.config import (
    TERM_NAME,
    RewardConfig,
    RewardTermConfig,
    RewardTermKind,
    UnroutedSourceError,
    unrouted_message,
)
from archon.rl.rewards.http import JudgeConfig, RewardServerConfig
from archon.rl.rewards.scorer import (
    MAX_LOGGED_FAILURES_PER_BATCH,
    NO_SOURCE,
    RewardBatch,
    RewardScorer,
    RewardTimeout,
    reward_breakdown,
)

__all__ = [
    "MAX_LOGGED_FAILURES_PER_BATCH",
    "NO_SOURCE",
    "TERM_NAME",
    "JudgeConfig",
    "RewardBatch",
    "RewardConfig",
    "RewardScorer",
    "RewardServerConfig",
    "RewardTermConfig",
    "RewardTermKind",
    "RewardTimeout",
    "UnroutedSourceError",
    "reward_breakdown",
    "unrouted_message",
]
