"""Moved to archon.rl.run.run_dir; its names stay importable from here for one release."""

from archon.rl.run.run_dir import (  # noqa: F401 - at its old path for one release
    ADAPTER_EXPORT,
    ADAPTERS,
    CHECKPOINTS,
    LOCK_FILE,
    RUN_OUTPUTS,
    SUPERSEDED,
    TASKS_DIR,
    PreparedRunDir,
    RunDirInUseError,
    RunDirLock,
    prepare_run_dir,
    prune_adapter_exports,
)
