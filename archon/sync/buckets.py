"""Bucketed tensor broadcast, now archon.parallel.buckets (the transport sits with the other process
groups, below the rollout engines and the syncs)."""

from archon.parallel.buckets import receive_tensors, send_tensors  # noqa: F401 - at its old path for one release
