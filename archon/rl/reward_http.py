"""archon.rl.reward_http, at its old path for one release: see archon.rl.rewards.http."""

from archon.rl.rewards.http import (  # noqa: F401 - at its old path for one release
    MAX_CHOICES,
    NUMBER,
    RETRIED_STATUSES,
    HttpOutcome,
    JudgeConfig,
    RewardRequestFailed,
    RewardServerConfig,
    judge_choices,
    judge_request,
    judge_rewards,
    parse_judge_score,
    post_json,
    server_rewards,
)
