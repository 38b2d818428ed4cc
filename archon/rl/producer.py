"""Moved to archon.rl.run.producer; its names stay importable from here for one release."""

from archon.rl.run.producer import (  # noqa: F401 - at its old path for one release
    RolloutProducer,
    Rollouts,
)
