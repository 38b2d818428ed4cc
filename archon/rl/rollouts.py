"""Moved to archon.rl.run.rollouts; its names stay importable from here for one release."""

from archon.rl.run.rollouts import (  # noqa: F401 - at its old path for one release
    concat_batches,
    distill_from_teachers,
    filler_batch,
    load_teacher,
    mixed_rollouts,
    packed_routed_experts,
    prompt_ids,
    replace_stale_groups,
    rollout_batch,
    rollout_servers,
    stop_token_ids,
    task_servers,
    teacher_logprobs,
)
