"""Asynchronous rollouts: a producer thread generates the rollouts of later RL steps while the
trainer trains on the current one, bounded by rollout.max_staleness.

The rollouts of step k need adapter version >= k - N (N = max_staleness), so the producer starts
step k only once that version is published; it runs at most N steps ahead, and each sample is
tagged with the version that made it. The trainer takes the steps in order. Generation here is HTTP
requests to rollout servers, so the thread runs no torch collectives and the trainer ranks stay in
lockstep on their own.
"""

from __future__ import annotations

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
    """Runs `generate(step)` for steps first..last-1 on a background thread.

    `published(version)` tells the producer that a new adapter version is served; `take(step)`
    returns the rollouts of `step`, waiting for them if they are not made yet."""

    def __init__(self, generate: Callable[[int], Rollouts], first: int, last: int, max_staleness: int, version: int):
        self._generate = generate
        self._max_staleness = max_staleness
        self._version = version
        self._changed = threading.Condition()
        self._ready: queue.Queue = queue.Queue()
        self._stop = False
        self._idle_s = 0.0
        self._last_call = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(first, last), name="archon-rollouts", daemon=True)
        self._thread.start()

    def _run(self, first: int, last: int) -> None:
        try:
            for step in range(first, last):
                waited = time.perf_counter()
                with self._changed:
                    while not self._stop and self._version < step - self._max_staleness:
                        self._changed.wait()
                    if self._stop:
                        return
                    self._idle_s += time.perf_counter() - waited
                self._ready.put(self._generate(step))
        except BaseException as error:  # raised again on the trainer's thread by take()
            self._ready.put(error)

    def published(self, version: int) -> None:
        with self._changed:
            self._version = version
            self._changed.notify_all()

    def take(self, step: int) -> Rollouts:
        waited = time.perf_counter()
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise RuntimeError(f"generating the rollouts of RL step {step + 1} failed") from item
        if item.step != step:
            raise RuntimeError(f"rollouts of step {item.step} arrived where step {step} was expected")
        item.wait_s = time.perf_counter() - waited
        return item

    def idle_since_last(self) -> tuple[float, float]:
        """(seconds the producer waited for a version, seconds elapsed) since the last call: the
        rollout side's idle time. Time spent on a step the trainer has not asked for yet is busy."""
        now = time.perf_counter()
        with self._changed:
            idle, self._idle_s = self._idle_s, 0.0
        elapsed, self._last_call = now - self._last_call, now
        return idle, elapsed

    def stop(self) -> None:
        """Start no further step (a generation under way runs on)."""
        with self._changed:
            self._stop = True
            self._changed.notify_all()

    def join(self, timeout: float = 30.0) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the rollout producer thread did not end within %.0f s; leaving it behind", timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.stop()
        self.join(timeout)
