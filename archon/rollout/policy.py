"""The published policy: which adapter version (and, on a server, under which served name) new
rollout requests use. The weight sync writes it, the rollout engine reads it; both may run in
different threads (a producer thread generating while the main thread publishes).

A request takes a lease for its duration (`lease()`): it reads (name, version) atomically when it
starts and keeps that pair until it ends. A name that a publish replaced is *retired*; the sync
unloads it from the servers only once no lease holds it (`take_unused`), so a request in flight
finishes on the version it started with, unless it follows the update policy 'continue': then it
watches `superseded()` and ends its lease at the next token, to go on under a new lease of the new
version (archon/rollout/vllm.py). For weights that are swapped in place (merged mode),
`exclusive()` waits for the requests in flight, holds new ones back meanwhile, and lets them go once
the new version is published, so (under 'finish') no request mixes versions.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator


class ServedPolicy:
    """(served adapter name, version) under a lock, with per-name leases. `name` None means the
    server's base model (merged weights, or no adapter yet)."""

    def __init__(self, name: str | None = None, version: int = 0) -> None:
        self._changed = threading.Condition()
        self._name, self._version = name, version
        self._leases: Counter[str | None] = Counter()
        self._retired: list[str] = []
        self._exclusive = False

    def current(self) -> tuple[str | None, int]:
        with self._changed:
            return self._name, self._version

    @property
    def version(self) -> int:
        return self.current()[1]

    @property
    def name(self) -> str | None:
        return self.current()[0]

    @contextlib.contextmanager
    def lease(self) -> Iterator[tuple[str | None, int]]:
        """(name, version) for one request, held until the request ends. Waits while a publish
        holds the policy exclusively."""
        with self._changed:
            self._changed.wait_for(lambda: not self._exclusive)
            name, version = self._name, self._version
            self._leases[name] += 1
        try:
            yield name, version
        finally:
            with self._changed:
                self._leases[name] -= 1
                if self._leases[name] == 0:
                    del self._leases[name]
                self._changed.notify_all()

    def superseded(self, version: int) -> bool:
        """Whether a request holding `version` should stop and go on under the next one (the update
        policy 'continue'): another version is published, or a publish waits to swap weights in place."""
        with self._changed:
            return self._exclusive or self._version != version

    def wait_released(self, names: set[str | None], timeout: float) -> bool:
        """Wait up to `timeout` seconds until no request holds any of `names`; whether none does."""
        with self._changed:
            return self._changed.wait_for(lambda: not names & set(self._leases), timeout)

    def leased_names(self) -> set[str | None]:
        """Names that requests in flight hold."""
        with self._changed:
            return set(self._leases)

    def in_flight(self) -> int:
        with self._changed:
            return sum(self._leases.values())

    def publish(self, name: str | None, version: int) -> None:
        """Later requests use `name` at `version`; the name replaced (if another one) is retired."""
        with self._changed:
            previous = self._name
            self._name, self._version = name, version
            if previous is not None and previous != name and previous not in self._retired:
                self._retired.append(previous)
            if name in self._retired:  # served again: no longer to be unloaded
                self._retired.remove(name)
            self._changed.notify_all()

    def take_unused(self, leased_elsewhere: set[str | None] = frozenset()) -> list[str]:
        """The retired names that no request holds here nor in `leased_elsewhere` (leases of other
        processes sharing the servers), oldest first; they are forgotten, for the caller to unload."""
        with self._changed:
            unused = [n for n in self._retired if n not in self._leases and n not in leased_elsewhere]
            self._retired = [n for n in self._retired if n not in unused]
            return unused

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold new requests back, wait for those in flight to end, and run the block (a weight
        swap) with none running. It does not wait for requests not yet started."""
        with self._changed:
            self._changed.wait_for(lambda: not self._exclusive)
            self._exclusive = True
            self._changed.wait_for(lambda: not self._leases)
        try:
            yield
        finally:
            with self._changed:
                self._exclusive = False
                self._changed.notify_all()
