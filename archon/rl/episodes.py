"""Moved to archon.rl.run.episodes; its names stay importable from here for one release."""

from archon.rl.run.episodes import (  # noqa: F401 - at its old path for one release
    episode_samples,
    score_episodes,
)
