"""Moved to archon.rl.run.versions; its names stay importable from here for one release."""

from archon.rl.run.versions import (  # noqa: F401 - at its old path for one release
    AdapterHistory,
    stale_groups,
)
