"""Reward scoring: a batch of completions -> a rewards tensor, robust to failing reward functions.

    scorer = RewardScorer(RewardConfig(function="math", timeout_s=5.0))
    rewards, metrics = scorer.score(prompts, completions, references)   # rewards: [B] float32
    scorer.close()

A reward is one function (`function`), or the weighted sum of several terms (`terms`): per-sample
functions, group functions that score all the completions of a prompt at once, a reward server
(archon.rl.rewards.http) and an LLM judge. `sources` routes each sample, by its row's `data_source`,
to the terms of its source (`default_terms` for sources not listed). `score_batch` also returns
each term's unweighted values and the per-term and per-source totals the RL step logs.

A reward function that raises, returns something that is not a finite float32 number (NaN, inf,
or beyond about 3.4e38), kills its process or runs past `timeout_s` gives that sample reward 0 and
is counted (metrics `reward_errors`, `reward_timeouts`); the run goes on, and the RL loop stops it
only when every sample fails for `max_failed_steps` steps in a row, showing `last_traceback`. A
reward function spec that cannot be loaded at all is a configuration error and raises when the
scorer is built. With several terms a failing term contributes 0 to the sample's reward, the others
count as usual, and the sample counts once in `reward_errors` (or `reward_timeouts`, when one of
its terms timed out) and under each failing term (`reward/<term>_errors`, ...).

Time limits. By default (num_workers >= 1) reward functions run in persistent worker processes
(`python -m archon.rl.reward_worker`, which does not import torch); a sample that overruns has its
worker killed and replaced, so any hang is stopped, in Python or in C code (a huge sympy or integer
computation, for example). num_workers=0 runs the function in this process under a SIGALRM timer:
no process start-up, but it works only on the main thread and only interrupts Python bytecode.
math-verify's own timeouts are also SIGALRM-based (main thread only, and they would cancel an outer
timer), so the built-in math reward switches them off and relies on these limits instead. A group
function's time limit is per call (one prompt's completions). Server and judge terms run in threads
of this process under their own time limits and retries.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from archon.rl.reward_worker import WorkerPool, load_reward_functions, run_on_workers, score_request
from archon.rl.rewards.config import RewardConfig, UnroutedSourceError, unrouted_message
from archon.rl.rewards.http import HttpOutcome, judge_rewards, server_rewards

logger = logging.getLogger("archon.rl.rewards")

MAX_LOGGED_FAILURES_PER_BATCH = 3
NO_SOURCE = "none"
"""The name the per-source metrics give rows without a data_source."""


def reward_breakdown(sums: dict[str, float]) -> dict[str, float]:
    """The metrics of summed per-term and per-source totals (RewardBatch.sums, possibly summed over
    ranks): reward/<term>_mean over the samples the term scored, its _samples and failure counts;
    source/<source>/reward_mean, /accuracy (reward >= 1) and /count."""
    metrics = {}
    for key, value in sums.items():
        if key.startswith("source/"):
            prefix, _, what = key.rpartition("/")
            count = max(sums[f"{prefix}/count"], 1.0)
            if what == "reward_sum":
                metrics[f"{prefix}/reward_mean"] = value / count
            elif what == "correct":
                metrics[f"{prefix}/accuracy"] = value / count
            else:
                metrics[key] = value
        elif key.endswith("_sum"):
            metrics[key[: -len("_sum")] + "_mean"] = value / max(sums[key[: -len("_sum")] + "_count"], 1.0)
        elif key.endswith("_count"):
            metrics[key[: -len("_count")] + "_samples"] = value
        else:
            metrics[key] = value
    return metrics


@dataclass
class RewardBatch:
    """A scored batch: rewards [B] (float32), the batch's metrics, each term's unweighted values
    (parts, [B] float32 by term name; only with `terms`), and `sums`, the per-term and per-source
    totals to add over ranks and turn into metrics with reward_breakdown."""

    rewards: torch.Tensor
    metrics: dict[str, float]
    parts: dict[str, torch.Tensor]
    sums: dict[str, float]


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
    """Scores batches with the configured reward terms; see the module doc for the time limits.

    Keeps running totals over its lifetime in `totals` (samples, errors, timeouts), and in
    `last_traceback` the traceback text of the first exception of the last batch, or the first
    failed request of a server or judge term (None when no sample of it raised or failed so).

    `data_sources`: the data_sources the run's rows have; each gets its own metrics when there are
    several or `sources` routes them (rows without one as source "none"), and one without terms is
    an UnroutedSourceError here, before any worker starts. Call close() (or use it as a context
    manager) to stop the worker processes.
    """

    def __init__(self, config: RewardConfig, data_sources: Sequence[str] = ()):
        self.config = config
        self.terms = config.term_configs()
        self.several = bool(config.terms)
        self.totals = {"samples": 0, "errors": 0, "timeouts": 0}
        self.last_traceback: str | None = None
        if unrouted := config.unrouted_sources(data_sources):
            raise UnroutedSourceError(unrouted_message(unrouted))
        known = sorted(set(data_sources))
        self.logged_sources = known if len(known) > 1 or config.sources else []
        self._term_index = {term.name: t for t, term in enumerate(self.terms)}
        self._routes: dict[str, list[int]] = {}
        # function and group terms share the workers: the t-th term is function _worker_slot[t] there
        specs = [term.function for term in self.terms if term.kind in ("function", "group")]
        self._worker_slot = {}
        for t, term in enumerate(self.terms):
            if term.kind in ("function", "group"):
                self._worker_slot[t] = len(self._worker_slot)
        self._functions = None
        if specs and config.num_workers == 0:
            self._functions = load_reward_functions(specs)
        elif specs:
            label = f"reward function {specs[0]!r}" if len(specs) == 1 else f"reward functions {specs!r}"
            self.start_workers("archon.rl.reward_worker", specs, label, config.num_workers)

    def route(self, data_source: str) -> list[int]:
        """The indices of the terms that score a sample of `data_source`; UnroutedSourceError when none are set."""
        if data_source not in self._routes:
            config = self.config
            if not config.sources:
                names = [term.name for term in self.terms]
            elif data_source in config.sources:
                names = list(config.sources[data_source])
            elif config.default_terms is not None:
                names = list(config.default_terms)
            else:
                raise UnroutedSourceError(unrouted_message([data_source]))
            self._routes[data_source] = [self._term_index[name] for name in names]
        return self._routes[data_source]

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], references: Sequence[Any] | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Rewards [B] (float32) for B completions, and metrics for this batch:
        reward_mean, reward_std (population), reward_errors, reward_timeouts, reward_seconds."""
        batch = self.score_batch(prompts, completions, references)
        return batch.rewards, batch.metrics

    def score_batch(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        references: Sequence[Any] | None = None,
        data_sources: Sequence[str] | None = None,
        extra_infos: Sequence[Any] | None = None,
        groups: Sequence[int] | None = None,
    ) -> RewardBatch:
        """Score B samples. data_sources route them (default ""), extra_infos are the rows'
        `extra_info` (default None) and groups the index of each sample's prompt: group terms score
        the samples of one group together (default: every sample its own group). The metrics are
        score()'s and, with several terms or logged sources, reward_breakdown's of this batch."""
        count = len(completions)
        references = [None] * count if references is None else references
        data_sources = [""] * count if data_sources is None else data_sources
        extra_infos = [None] * count if extra_infos is None else extra_infos
        groups = list(range(count)) if groups is None else groups
        lengths = {len(prompts), len(references), len(data_sources), len(extra_infos), len(groups)}
        if lengths != {count}:
            raise ValueError(
                f"score() got {len(prompts)} prompts, {count} completions, {len(references)} references, "
                f"{len(data_sources)} data_sources, {len(extra_infos)} extra_infos, {len(groups)} groups"
            )
        start = time.monotonic()
        routes = [self.route(source) for source in data_sources]
        samples = [
            {"prompt": p, "completion": c, "reference": r, "data_source": d, "extra_info": e}
            for p, c, r, d, e in zip(prompts, completions, references, data_sources, extra_infos)
        ]
        members = [[i for i in range(count) if t in routes[i]] for t in range(len(self.terms))]
        values, failures, http_counts = self._score_terms(samples, groups, members)
        parts, rewards = self._weighted_sum(values, failures, count)
        errors, timeouts = self._count_failures(failures)
        self.totals["samples"] += count
        self.totals["errors"] += errors
        self.totals["timeouts"] += timeouts
        sums = self._sums(members, parts, failures, http_counts, rewards, data_sources)
        metrics = {
            "reward_mean": rewards.double().mean().item() if count else 0.0,
            "reward_std": rewards.double().std(correction=0).item() if count else 0.0,
            "reward_errors": float(errors),
            "reward_timeouts": float(timeouts),
            "reward_seconds": time.monotonic() - start,
            **reward_breakdown(sums),
        }
        return RewardBatch(rewards, metrics, parts if self.several else {}, sums)

    def _score_terms(self, samples, groups, members):
        """Each term's values ([term][sample], 0.0 where it has none), the failures (term, kind,
        sample, message, traceback) and the outcome of each server or judge term's requests."""
        count = len(samples)
        values = [[0.0] * count for _ in self.terms]
        failures: list[tuple[int, str, int, str, str | None]] = []  # (term, kind, sample, message, traceback)
        http_counts: dict[int, HttpOutcome] = {}
        http_terms = [t for t, term in enumerate(self.terms) if term.kind in ("server", "judge") and members[t]]
        with ThreadPoolExecutor(max_workers=max(1, len(http_terms))) as pool:
            futures = {}
            for t in http_terms:
                term = self.terms[t]
                call = server_rewards if term.kind == "server" else judge_rewards
                futures[t] = pool.submit(
                    call, term.server if term.kind == "server" else term.judge, [samples[i] for i in members[t]]
                )
            self._score_functions(samples, groups, members, values, failures)
            for t, future in futures.items():
                outcome = http_counts[t] = future.result()
                for i, value, failure in zip(members[t], outcome.values, outcome.failures):
                    if failure is None:
                        values[t][i] = value
                    else:
                        # no traceback to show: the request's failure stands in for one
                        failures.append((t, failure[0], i, failure[1], f"term {self.terms[t].name!r}: {failure[1]}"))
        return values, failures, http_counts

    def _weighted_sum(self, values, failures, count) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each term's values as a float32 tensor [B], non-finite ones made 0 and counted as failures,
        and the rewards [B]: the weighted sum of the terms, in float64, as float32."""
        # call_reward rejects NaN and inf; a value beyond the float32 range becomes inf here.
        parts = {}
        failed = {(t, i) for t, _, i, _, _ in failures}
        for t, term in enumerate(self.terms):
            part = torch.tensor(values[t], dtype=torch.float32)
            for i in (~torch.isfinite(part)).nonzero()[:, 0].tolist():
                if (t, i) not in failed:
                    failures.append((t, "error", i, f"reward {values[t][i]!r} is not a finite float32 number", None))
                part[i] = 0.0
            parts[term.name] = part
        rewards = torch.zeros(count, dtype=torch.float64)
        for term in self.terms:
            rewards += term.weight * parts[term.name].double()
        return parts, rewards.float()

    def _count_failures(self, failures) -> tuple[int, int]:
        """(samples with an error, samples with a timeout) among the failures, sorted here by sample;
        the first few are logged and the first traceback kept."""
        failures.sort(key=lambda failure: (failure[2], failure[0]))
        self.last_traceback = next((tb for *_, tb in failures if tb is not None), None)
        sample_kinds: dict[int, str] = {}
        for _, kind, i, _, _ in failures:
            sample_kinds[i] = "timeout" if kind == "timeout" or sample_kinds.get(i) == "timeout" else "error"
        errors = sum(1 for kind in sample_kinds.values() if kind == "error")
        timeouts = len(sample_kinds) - errors
        for t, kind, index, message, _ in failures[:MAX_LOGGED_FAILURES_PER_BATCH]:
            term = f" (term {self.terms[t].name!r})" if self.several else ""
            logger.warning("reward %s for sample %d%s: %s", kind, index, term, message)
        if len(failures) > MAX_LOGGED_FAILURES_PER_BATCH:
            unlogged = len(failures) - MAX_LOGGED_FAILURES_PER_BATCH
            logger.warning("... and %d more reward failures in this batch", unlogged)
        return errors, timeouts

    def _sums(self, members, parts, failures, http_counts, rewards, data_sources) -> dict[str, float]:
        """RewardBatch.sums: the same keys, in the same order, for every batch."""
        sums: dict[str, float] = {}
        if self.several:
            for t, term in enumerate(self.terms):
                key = f"reward/{term.name}"
                kinds = [kind for u, kind, _, _, _ in failures if u == t]
                sums[f"{key}_sum"] = float(parts[term.name].double()[members[t]].sum()) if members[t] else 0.0
                sums[f"{key}_count"] = float(len(members[t]))
                sums[f"{key}_errors"] = float(kinds.count("error"))
                sums[f"{key}_timeouts"] = float(kinds.count("timeout"))
                if term.kind == "judge":
                    sums[f"{key}_parse_failures"] = float(kinds.count("parse"))
                if term.kind in ("server", "judge"):
                    outcome = http_counts.get(t)
                    sums[f"{key}_requests"] = float(outcome.requests if outcome else 0)
                    sums[f"{key}_retries"] = float(outcome.retries if outcome else 0)
        for source in self.logged_sources:
            mine = torch.tensor([s == source for s in data_sources], dtype=torch.bool)
            key = f"source/{source or NO_SOURCE}"
            sums[f"{key}/reward_sum"] = float(rewards.double()[mine].sum())
            sums[f"{key}/correct"] = float((rewards[mine] >= 1.0).sum())
            sums[f"{key}/count"] = float(mine.sum())
        return sums

    def _score_functions(self, samples, groups, members, values, failures) -> None:
        """Fill in the values (and failures) of the function and group terms."""
        requests, targets = [], []  # targets: (term, the sample indices the request scores)
        for t, term in enumerate(self.terms):
            if term.kind == "function":
                for i in members[t]:
                    sample = samples[i]
                    requests.append(
                        (
                            "score",
                            self._worker_slot[t],
                            sample["prompt"],
                            sample["completion"],
                            sample["reference"],
                            sample["data_source"],
                            sample["extra_info"],
                        )
                    )
                    targets.append((t, [i]))
            elif term.kind == "group":
                by_group: dict[int, list[int]] = {}
                for i in members[t]:
                    by_group.setdefault(groups[i], []).append(i)
                for indices in by_group.values():
                    first = samples[indices[0]]
                    requests.append(
                        (
                            "score_group",
                            self._worker_slot[t],
                            first["prompt"],
                            [samples[i]["completion"] for i in indices],
                            first["reference"],
                            first["data_source"],
                            first["extra_info"],
                        )
                    )
                    targets.append((t, indices))
        if not requests:
            return
        replies = self._run_in_process(requests) if self._functions is not None else self._run_in_workers(requests)
        for (t, indices), (kind, detail, tb) in zip(targets, replies):
            if kind == "ok":
                for i, value in zip(indices, detail if isinstance(detail, list) else [detail]):
                    values[t][i] = value
            else:
                failures.extend((t, kind, i, detail, tb) for i in indices)

    def _run_in_process(self, requests) -> list[tuple[str, Any, str | None]]:
        """Each request's (kind, value or message, traceback): kind "ok", "error" or "timeout"."""
        replies = []
        for request in requests:
            try:
                with _alarm(self.config.timeout_s):
                    reply = score_request(self._functions, request)
            except RewardTimeout:
                replies.append(("timeout", f"over {self.config.timeout_s} s", None))
                continue
            replies.append(_reply(reply))
        return replies

    def _run_in_workers(self, requests) -> list[tuple[str, Any, str | None]]:
        replies = []
        for outcome in run_on_workers(self._workers, requests, self.config.timeout_s):
            if outcome.failure == "timeout":
                replies.append(("timeout", f"over {self.config.timeout_s} s; worker restarted", None))
            elif outcome.failure == "died":
                replies.append(("error", f"reward worker died: {outcome.detail}", None))
            elif outcome.failure == "unavailable":
                replies.append(("error", f"reward worker unavailable: {outcome.detail}", None))
            else:
                replies.append(_reply(outcome.reply))
        return replies


def _reply(reply: tuple) -> tuple[str, Any, str | None]:
    """A worker's reply as (kind, value or message, traceback)."""
    if reply[0] == "ok":
        return ("ok", reply[1], None)
    return ("error", reply[1], reply[2] if len(reply) > 2 else None)
