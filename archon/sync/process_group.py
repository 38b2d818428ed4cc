"""The stateless process group, now archon.parallel.process_group (the transport sits with the other
process groups, below the rollout engines and the syncs)."""

from archon.parallel.process_group import StatelessGroup  # noqa: F401 - at its old path for one release
