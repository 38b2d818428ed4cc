"""Moved to archon.rl.run.loop; its names stay importable from here for one release."""

from archon.rl.run.loop import RLRun  # noqa: F401 - at its old path for one release
