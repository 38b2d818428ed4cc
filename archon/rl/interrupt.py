"""Moved to archon.rl.run.interrupt; its names stay importable from here for one release."""

from archon.rl.run.interrupt import (  # noqa: F401 - at its old path for one release
    Terminated,
    terminate_as_interrupt,
)
