"""Moved to archon.rl.run.task; its names stay importable from here for one release."""

from archon.rl.run.task import (  # noqa: F401 - at its old path for one release
    STOPPED_FILE,
    RewardFunctionError,
    Task,
    read_stopped_record,
    resume_named_tasks,
    source_teachers,
)
