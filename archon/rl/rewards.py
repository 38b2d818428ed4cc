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
import io
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from archon.rl.reward_fns import call_reward, resolve_reward_function
from archon.rl.reward_worker import _HEADER, read_message, write_message

logger = logging.getLogger(__name__)

WORKER_STARTUP_TIMEOUT_S = 120.0
MAX_LOGGED_FAILURES_PER_BATCH = 3
EXIT_WAIT_S = 5.0
"""How long a worker whose output closed gets to finish exiting before it counts as hung."""


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


class _WorkerProcess:
    """One reward worker process, seen from the parent."""

    def __init__(self, spec: str):
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self._buffer = b""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the process and load the reward function; raises RuntimeError on failure."""
        self.stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "archon.rl.reward_worker", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._buffer = b""
        self.send(("init", self.spec, list(sys.path)))
        reply = self.receive(time.monotonic() + WORKER_STARTUP_TIMEOUT_S)
        if reply is None or reply == "eof":
            reason = self.exit_reason() if reply == "eof" else f"no reply in {WORKER_STARTUP_TIMEOUT_S:.0f} s"
            self.stop()
            raise RuntimeError(f"reward worker for {self.spec!r} did not start: {reason}")
        if reply[0] != "ready":
            self.stop()
            raise RuntimeError(f"reward function {self.spec!r} could not be loaded: {reply[1]}")

    def send(self, message: Any) -> None:
        write_message(self.proc.stdin, message)

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def read_available(self) -> bool:
        """Read what the pipe holds now; False at end of stream."""
        chunk = os.read(self.fileno(), 1 << 16)
        self._buffer += chunk
        return bool(chunk)

    def take_message(self) -> Any | None:
        if len(self._buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buffer)
        if len(self._buffer) < _HEADER.size + size:
            return None
        frame, self._buffer = self._buffer[: _HEADER.size + size], self._buffer[_HEADER.size + size :]
        return read_message(io.BytesIO(frame))

    def receive(self, deadline: float) -> Any | None:
        """Wait for one reply until `deadline`: the message, "eof", or None on timeout."""
        while (message := self.take_message()) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([self.fileno()], [], [], remaining)
            if readable and not self.read_available():
                return "eof"
        return message

    def exit_reason(self) -> str:
        """Why the process ended, once its output has closed: its exit code or the signal that killed it."""
        try:
            code = self.proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return f"it closed its output but was still running {EXIT_WAIT_S:.0f} s later"
        if code >= 0:
            return f"it exited with code {code}"
        try:
            name = signal.Signals(-code).name
        except ValueError:  # a signal without a name (real-time signals)
            name = f"signal {-code}"
        if -code == signal.SIGKILL:
            return f"it was killed by {name} (the kernel's out-of-memory killer sends SIGKILL; see dmesg)"
        return f"it was killed by {name}"

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        with contextlib.suppress(OSError):
            proc.stdin.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


class RewardScorer:
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
        self._workers: list[_WorkerProcess] = []
        if config.num_workers == 0:
            self._fn = resolve_reward_function(config.function)
        else:
            self._workers = [_WorkerProcess(config.function) for _ in range(config.num_workers)]
            try:
                for worker in self._workers:
                    worker.start()
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        for worker in getattr(self, "_workers", []):
            worker.stop()

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
        pending = deque(range(len(samples)))
        busy: dict[_WorkerProcess, tuple[int, float]] = {}
        while pending or busy:
            for worker in self._workers:
                if worker in busy or not pending:
                    continue
                index = pending.popleft()
                try:
                    if not worker.alive:
                        worker.start()
                    worker.send(("score", *samples[index]))
                except (RuntimeError, OSError) as exc:
                    worker.stop()
                    failures.append(("error", index, f"reward worker unavailable: {exc}", None))
                    continue
                busy[worker] = (index, time.monotonic() + self.config.timeout_s)
            if not busy:
                continue
            wait = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
            readable, _, _ = select.select(list(busy), [], [], wait)
            for worker in readable:
                index, _ = busy[worker]
                open_ = worker.read_available()
                message = worker.take_message()
                if message is not None:
                    del busy[worker]
                    if message[0] == "ok":
                        values[index] = message[1]
                    else:
                        # ("error", description[, traceback text])
                        failures.append(("error", index, message[1], message[2] if len(message) > 2 else None))
                elif not open_:
                    del busy[worker]
                    reason = worker.exit_reason()
                    worker.stop()
                    failures.append(("error", index, f"reward worker died: {reason}", None))
            now = time.monotonic()
            for worker, (index, deadline) in list(busy.items()):
                if deadline <= now:
                    del busy[worker]
                    worker.stop()
                    failures.append(("timeout", index, f"over {self.config.timeout_s} s; worker restarted", None))
        return values, failures
