"""Moved to archon.rl.run.step_metrics; its names stay importable from here for one release."""

from archon.rl.run.step_metrics import (  # noqa: F401 - at its old path for one release
    UPDATE_BOOKKEEPING,
    Prepared,
    Scores,
    distill_metrics,
    every_reward_failed,
    task_step_metrics,
    update_summary,
)
