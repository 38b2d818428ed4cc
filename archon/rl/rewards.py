"""Reward scoring: a batch of completions -> a rewards tensor, robust to failing reward functions.

    scorer = RewardScorer(RewardConfig(function="math", timeout_s=5.0))
    rewards, metrics = scorer.score(prompts, completions, references)   # rewards: [B] float32
    scorer.close()

A reward function that raises, returns something that is not a finite float32 number (NaN, inf,
or beyond about 3.4e38), kills its process or runs past `timeout_s` gives that sample reward 0 and
is counted (metrics `reward_errors`, `reward_timeouts`); the run goes on, and the RL loop stops it
only when every sample fails for `max_failed_steps` steps in a row, showing `last_traceback`. A
reward function spec that cannot be loaded at all is a configuration error and raises when the
scorer is built.

Time limits. By default (num_workers >= 1) reward functions run in persistent worker processes
(`python -m archon.rl.reward_worker`, which does not import torch); a sample that overruns has its
worker killed and replaced, so any hang is stopped, in Python or in C code (a huge sympy or integer
computation, for example). num_workers=0 runs the function in this process under a SIGALRM timer:
no process start-up, but it works only on the main thread and only interrupts Python bytecode.
math-verify's own timeouts are also SIGALRM-based (main thread only, and they would cancel an outer
timer), so the built-in math reward switches them off and relies on these limits instead.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from archon.rl.reward_fns import call_reward, resolve_reward_function
from archon.rl.reward_worker import WorkerPool, run_on_workers

logger = logging.getLogger(__name__)

MAX_LOGGED_FAILURES_PER_BATCH = 3


@dataclass
class RewardConfig:
    """How completions are scored."""

    function: str = "math"
    """math (math-verify against the reference), exact (exact match), or package.module:function
    taking (prompt, completion, reference) and returning a float."""
    timeout_s: float = 10.0
    """Per-sample time limit; a sample over it gets reward 0 and counts as a timeout."""
    num_workers: int = 1
    """Worker processes that run the reward function. 0 runs it in this process under a SIGALRM
    timer: main thread only, and a hang inside C code is not interrupted."""
    max_failed_steps: int = 3
    """Stop the run, showing the reward function's traceback, when it fails (raises or times out)
    on every sample of this many steps in a row."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"RewardConfig.timeout_s must be positive, got {self.timeout_s}")
        if self.num_workers < 0:
            raise ValueError(f"RewardConfig.num_workers must be >= 0, got {self.num_workers}")
        if self.max_failed_steps < 1:
            raise ValueError(f"RewardConfig.max_failed_steps must be >= 1, got {self.max_failed_steps}")


class RewardTimeout(BaseException):
    """Raised by the in-process timer. A BaseException, so `except Exception` in user code cannot swallow it."""


@contextlib.contextmanager
def _alarm(seconds: float):
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "in-process rewards (num_workers=0) need the main thread for their timer; use num_workers >= 1"
        )

    def on_alarm(signum, frame):
        raise RewardTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class RewardScorer(WorkerPool):
    """Scores batches with the configured reward function; see the module doc for the time limits.

    Keeps running totals over its lifetime in `totals` (samples, errors, timeouts), and in
    `last_traceback` the traceback text of the first exception of the last batch (None when no
    sample of it raised). Call close() (or use it as a context manager) to stop the worker processes.
    """

    def __init__(self, config: RewardConfig):
        self.config = config
        self.totals = {"samples": 0, "errors": 0, "timeouts": 0}
        self.last_traceback: str | None = None
        self._fn = None
        if config.num_workers == 0:
            self._fn = resolve_reward_function(config.function)
        else:
            label = f"reward function {config.function!r}"
            self.start_workers("archon.rl.reward_worker", config.function, label, config.num_workers)

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], references: Sequence[Any] | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Rewards [B] (float32) for B completions, and metrics for this batch:
        reward_mean, reward_std (population), reward_errors, reward_timeouts, reward_seconds."""
        if references is None:
            references = [None] * len(completions)
        if not len(prompts) == len(completions) == len(references):
            raise ValueError(
                f"score() got {len(prompts)} prompts, {len(completions)} completions, {len(references)} references"
            )
        start = time.monotonic()
        samples = list(zip(prompts, completions, references))
        if self._fn is not None:
            values, failures = self._score_in_process(samples)
        else:
            values, failures = self._score_in_workers(samples)
        rewards = torch.tensor(values, dtype=torch.float32)
        # call_reward rejects NaN and inf; a value beyond the float32 range becomes inf here.
        for index in (~torch.isfinite(rewards)).nonzero()[:, 0].tolist():
            failures.append(("error", index, f"reward {values[index]!r} is not a finite float32 number", None))
            rewards[index] = 0.0
        failures.sort(key=lambda failure: failure[1])
        self.last_traceback = next((tb for kind, _, _, tb in failures if tb is not None), None)
        errors = sum(1 for kind, _, _, _ in failures if kind == "error")
        timeouts = len(failures) - errors
        for kind, index, message, _ in failures[:MAX_LOGGED_FAILURES_PER_BATCH]:
            logger.warning("reward %s for sample %d (reward 0): %s", kind, index, message)
        if len(failures) > MAX_LOGGED_FAILURES_PER_BATCH:
            unlogged = len(failures) - MAX_LOGGED_FAILURES_PER_BATCH
            logger.warning("... and %d more reward failures in this batch", unlogged)
        self.totals["samples"] += len(samples)
        self.totals["errors"] += errors
        self.totals["timeouts"] += timeouts
        metrics = {
            "reward_mean": rewards.double().mean().item() if len(values) else 0.0,
            "reward_std": rewards.double().std(correction=0).item() if len(values) else 0.0,
            "reward_errors": float(errors),
            "reward_timeouts": float(timeouts),
            "reward_seconds": time.monotonic() - start,
        }
        return rewards, metrics

    def _score_in_process(self, samples):
        values = [0.0] * len(samples)
        failures = []
        for index, (prompt, completion, reference) in enumerate(samples):
            try:
                with _alarm(self.config.timeout_s):
                    values[index] = call_reward(self._fn, prompt, completion, reference)
            except RewardTimeout:
                failures.append(("timeout", index, f"over {self.config.timeout_s} s", None))
            except Exception as exc:  # noqa: BLE001 - a failing reward is counted, not fatal
                failures.append(("error", index, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return values, failures

    def _score_in_workers(self, samples):
        values = [0.0] * len(samples)
        failures = []
        outcomes = run_on_workers(self._workers, [("score", *sample) for sample in samples], self.config.timeout_s)
        for index, outcome in enumerate(outcomes):
            if outcome.failure == "timeout":
                failures.append(("timeout", index, f"over {self.config.timeout_s} s; worker restarted", None))
            elif outcome.failure == "died":
                failures.append(("error", index, f"reward worker died: {outcome.detail}", None))
            elif outcome.failure == "unavailable":
                failures.append(("error", index, f"reward worker unavailable: {outcome.detail}", None))
            elif outcome.reply[0] == "ok":
                values[index] = outcome.reply[1]
            else:  # ("error", description[, traceback text])
                reply = outcome.reply
                failures.append(("error", index, reply[1], reply[2] if len(reply) > 2 else None))
        return values, failures
