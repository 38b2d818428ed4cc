"""Asynchronous rollouts: a producer thread starts the rollouts of later RL steps while the
trainer trains on the current one, bounded by rollout.max_staleness.

The rollouts of step k need adapter version >= k - N (N = max_staleness), so the producer starts
step k only once that version is published; it runs at most N steps ahead, and each token is
tagged with the version that sampled it. Steps overlap: once step k's prompts are drawn, its
generation runs on a thread of its own, so step k+1's requests start (when its version allows)
while step k's longest samples are still generating; at most N + 1 steps generate at once. The
trainer takes the steps in order. The threads run no torch collectives (vLLM rollouts are HTTP
requests; the built-in engine's asynchronous rollouts are for one process), so the trainer ranks
stay in lockstep on their own.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from archon.rollout.base import Sample

logger = logging.getLogger("archon.rl")


@dataclass
class Rollouts:
    """One RL step's rollouts on this rank: its prompts, their samples (group_size per prompt, in
    prompt order) and where the data iterator stood once the prompts were drawn."""

    step: int
    examples: list
    samples: list[Sample]
    iterator_state: dict[str, Any]
    generate_s: float
    wait_s: float = 0.0
    """How long the trainer waited for these rollouts (trainer idle time)."""
    stale_dropped: int = 0
    """Samples of groups dropped for staleness and sampled again."""


class RolloutProducer:
    """Makes the rollouts of steps first..last-1 on background threads.

    `generate(step)` runs on the producer's thread, in step order, once the step may start. It
    returns the step's Rollouts (made there, one step after the other), or a function that makes
    them, with the step's prompts already drawn: that function then runs on a thread of its own, so
    that the next steps start while it generates (overlapping steps).

    `published(version)` tells the producer that a new adapter version is served (after
    `on_publish(version)`, which serves it to the producer's engines where the run does not);
    `take(step)` returns the rollouts of `step`, waiting for them if they are not made yet."""

    def __init__(
        self,
        generate: Callable[[int], Rollouts | Callable[[], Rollouts]],
        first: int,
        last: int,
        max_staleness: int,
        version: int,
        on_publish: Callable[[int], None] | None = None,
    ):
        self._generate = generate
        self._max_staleness = max_staleness
        self._version = version
        self._on_publish = on_publish
        self._changed = threading.Condition()
        self._ready: queue.Queue = queue.Queue()
        self._stop = False
        self._waiting = False
        """The producer waits for a version before it may start its next step."""
        self._running = 0
        """Steps generating on threads of their own now."""
        self._workers: list[threading.Thread] = []
        self._idle_s = 0.0
        self._idle_since: float | None = None
        self._last_call = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(first, last), name="archon-rollouts", daemon=True)
        self._thread.start()

    def _run(self, first: int, last: int) -> None:
        try:
            for step in range(first, last):
                with self._changed:
                    self._waiting = True
                    self._account_idle()
                    while not self._stop and self._version < step - self._max_staleness:
                        self._changed.wait()
                    self._waiting = False
                    self._account_idle()
                    if self._stop:
                        return
                made = self._generate(step)
                if isinstance(made, Rollouts):
                    self._ready.put(made)
                else:
                    self._ready.put(self._start(step, made))
        except BaseException as error:  # raised again on the trainer's thread by take()
            self._ready.put(error)

    def _start(self, step: int, make: Callable[[], Rollouts]) -> concurrent.futures.Future:
        """Run `make()` (step `step`'s generation) on a thread of its own; its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(make())
            except BaseException as error:  # raised again on the trainer's thread by take()
                future.set_exception(error)
            finally:
                with self._changed:
                    self._running -= 1
                    self._account_idle()

        with self._changed:
            self._running += 1
            self._account_idle()
        worker = threading.Thread(target=run, name=f"archon-rollouts-step-{step}", daemon=True)
        self._workers.append(worker)
        worker.start()
        return future

    def _account_idle(self) -> None:
        """Count the time the rollout side is idle: the producer waits for a version and no step is
        generating. Called under the lock after each change of either."""
        now = time.perf_counter()
        if self._idle_since is not None:
            self._idle_s += now - self._idle_since
        self._idle_since = now if self._waiting and self._running == 0 else None

    def published(self, version: int) -> None:
        if self._on_publish is not None:
            self._on_publish(version)
        with self._changed:
            self._version = version
            self._changed.notify_all()

    def take(self, step: int) -> Rollouts:
        waited = time.perf_counter()
        item = self._ready.get()
        if isinstance(item, concurrent.futures.Future):
            try:
                item = item.result()
            except BaseException as error:
                item = error
        if isinstance(item, BaseException):
            raise RuntimeError(f"generating the rollouts of RL step {step + 1} failed") from item
        if item.step != step:
            raise RuntimeError(f"rollouts of step {item.step} arrived where step {step} was expected")
        item.wait_s = time.perf_counter() - waited
        return item

    def idle_since_last(self) -> tuple[float, float]:
        """(seconds the rollout side was idle, seconds elapsed) since the last call: idle is waiting
        for a version with no step generating. Time spent on a step the trainer has not asked for
        yet is busy."""
        now = time.perf_counter()
        with self._changed:
            self._account_idle()
            idle, self._idle_s = self._idle_s, 0.0
        elapsed, self._last_call = now - self._last_call, now
        return idle, elapsed

    def stop(self) -> None:
        """Start no further step (generations under way run on)."""
        with self._changed:
            self._stop = True
            self._changed.notify_all()

    def join(self, timeout: float = 30.0) -> None:
        deadline = time.perf_counter() + timeout
        for thread in [self._thread, *self._workers]:
            thread.join(max(deadline - time.perf_counter(), 0.0))
            if thread.is_alive():
                logger.warning(
                    "the rollout thread %s did not end within %.0f s; leaving it behind", thread.name, timeout
                )
                return

    def close(self, timeout: float = 30.0) -> None:
        self.stop()
        self.join(timeout)
