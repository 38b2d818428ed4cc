"""What an RL step reports: the phases' results a task's metrics are made of, and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from archon.rl.rewards import NO_SOURCE, reward_breakdown
from archon.rl.run.producer import Rollouts

UPDATE_BOOKKEEPING = {
    "lr",
    "skipped",
    "tokens",
    "sequences",
    "total_tokens",
    "micro_batches",
    "optimizer_steps",
    "time_s",
    "num_tokens",
}
"""What Trainer.train_step reports about an update itself; the step logs its own counts and times."""


@dataclass
class Scores:
    """Per-sample rewards, whether each is correct (reward >= 1), response lengths, and the reward
    workers' error counts."""

    rewards: torch.Tensor
    correct: torch.Tensor
    lengths: torch.Tensor
    reward_metrics: dict[str, float]
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each reward term's unweighted value per sample ([B] float32, by term name), when the reward
    has several terms; the rewards are their weighted sum."""
    episode_sums: dict[str, float] = field(default_factory=dict)
    """Multi-turn tasks: per-sample quantities summed over this rank's samples (turns, tool calls,
    environment tokens, one count per stop reason); logged as their means over all ranks."""
    reward_sums: dict[str, float] = field(default_factory=dict)
    """Per-term and per-source reward totals of this rank's samples (RewardBatch.sums: the same keys
    on every rank), summed over the ranks and logged through rewards.reward_breakdown."""


def _no_gaps() -> dict[str, torch.Tensor]:
    """The log-prob gaps of a task without trained tokens: none of each kind."""
    return dict.fromkeys(("total", "numerics", "lag"), torch.zeros(0))


@dataclass(frozen=True)
class RewardCounts:
    """A task's samples of an RL step and those its reward function failed on (raised, or timed
    out), summed over the data-parallel ranks once: the step's metrics and the decision whether the
    task trains (and, steps in a row, whether it stops) are read from this one record."""

    errors: float
    timeouts: float
    samples: float

    @property
    def every_failed(self) -> bool:
        return every_reward_failed(self.errors + self.timeouts, self.samples)


@dataclass
class Prepared:
    """What the prepare phase decided for a task beside the batch: the shaped rewards, which samples
    the batch filters kept, its reward failures (whether it trains this step follows from them), the
    largest |reward| and |advantage| over the ranks (`extremes`, for the non-finite error), and the
    trainer-rollout log-prob gaps (prepare._logprob_gaps) and version lags [its loss tokens] of its
    trained tokens."""

    rewards: torch.Tensor
    keep: torch.Tensor
    reward_counts: RewardCounts
    extremes: dict[str, float] = field(default_factory=dict)
    gaps: dict[str, torch.Tensor] = field(default_factory=lambda: _no_gaps())
    lag: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    tokens: float = 0.0
    distill_gaps: dict[str, tuple[float, float]] = field(default_factory=dict)
    """On-policy distillation: by data source, the summed log-prob gap log pi_student - log pi_teacher
    over the source's trained loss tokens on this rank, and their count."""

    @property
    def trains(self) -> bool:
        """The task takes an update this step: its reward function did not fail on every sample."""
        return not self.reward_counts.every_failed


@dataclass
class TaskStep:
    """One task's RL step as the phases fill it in: its rollouts (collect), their scores and the
    reward function's first failure (score), what prepare decided for it, the updates it took
    (update) and what its weight sync sent (publish)."""

    task: Any
    rollouts: Rollouts
    scores: Scores
    reward_traceback: str | None = None
    prepared: Prepared | None = None
    updates: list[dict[str, float]] = field(default_factory=list)
    sync: dict[str, float] = field(default_factory=dict)

    @property
    def skipped_updates(self):
        """Updates skipped for a non-finite loss or gradient (the same on every rank)."""
        return sum(u["skipped"] for u in self.updates)


def every_reward_failed(failures: float, samples: float) -> bool:
    """The reward function failed (raised or timed out) on every one of a step's `samples`."""
    return samples > 0 and failures >= samples


def update_summary(updates: list[dict[str, float]]) -> dict[str, float]:
    """An RL step's training metrics: the loss, the gradient norm and every metric the loss reports,
    averaged over the applied updates (`*_max` / `*_min`: the extreme); with every update skipped,
    the last update's (non-finite) values. `lr` is the step's (the schedule moves once per RL step)."""
    applied = [u for u in updates if not u["skipped"]] or updates[-1:]
    summary = {"lr": updates[0]["lr"]}
    for key in applied[0]:
        if key in UPDATE_BOOKKEEPING:
            continue
        values = [u[key] for u in applied]
        if key.endswith("_max") or key.endswith("_min"):
            summary[key] = max(values) if key.endswith("_max") else min(values)
        else:
            summary[key] = sum(values) / len(values)
    return summary


def step_metrics(
    task_steps: list[TaskStep], timings: dict[str, float], group_size: int, dp_sum, dp_max, several_tasks: bool
) -> dict[str, float]:
    """An RL step's metrics: each task's (task_step_metrics, under its prefix), the phases' `timings`,
    the training throughput over all ranks and, in a run of several tasks, how many are active."""
    metrics: dict[str, float] = {}
    tokens = 0.0
    for task_step in task_steps:
        task_metrics = task_step_metrics(task_step, timings["step_s"], group_size, dp_sum, dp_max)
        tokens += task_metrics.pop("tokens")
        metrics.update({task_step.task.prefix + key: value for key, value in task_metrics.items()})
    metrics.update(timings)
    metrics["tokens_per_s"] = tokens / timings["step_s"]  # the step's training batch, all ranks
    if several_tasks:
        metrics["active_tasks"] = float(len(task_steps))
    return metrics


def task_step_metrics(task_step: TaskStep, step_s: float, group_size: int, dp_sum, dp_max) -> dict[str, float]:
    """The metrics of a task's RL step (without its prefix), summed (`dp_sum(*values)`) or maxed
    (`dp_max(value)`) over the data-parallel ranks, and `tokens`, its trained tokens on all ranks."""
    scores, prepared, updates = task_step.scores, task_step.prepared, task_step.updates
    totals = _totals(task_step, group_size, dp_sum)
    metrics = _sample_metrics(task_step, totals, dp_max)
    metrics.update(_version_metrics(task_step, totals, step_s, dp_max))
    if scores.episode_sums:
        names = sorted(scores.episode_sums)
        n = prepared.reward_counts.samples
        for name, total in zip(names, dp_sum(*(scores.episode_sums[k] for k in names))):
            metrics[name] = total / max(n, 1.0)
    metrics.update(distill_metrics(task_step.task, prepared, dp_sum))
    if scores.reward_sums:
        names = list(scores.reward_sums)
        metrics.update(reward_breakdown(dict(zip(names, dp_sum(*(scores.reward_sums[k] for k in names))))))
    metrics.update({k: v for k, v in task_step.sync.items() if k != "sync_s"})
    if updates:
        metrics.update(update_summary(updates))
    return metrics


_TOTALS = (
    "reward_sum",
    "reward_sq",
    "correct",
    "length",
    "gap",
    "gap_n",
    "numerics",
    "lag_gap",
    "kept_groups",
    "tokens",
    "lag",
    "stale",
    "mixed",
)


def _totals(task_step: TaskStep, group_size: int, dp_sum) -> dict[str, float]:
    """The task's per-sample and per-token quantities of the step summed over the ranks, in one
    reduction (the reward failures and sample count are in prepared.reward_counts already)."""
    rollouts, scores, prepared = task_step.rollouts, task_step.scores, task_step.prepared
    rewards, gaps = prepared.rewards, prepared.gaps
    summed = dp_sum(
        float(rewards.double().sum()),
        float((rewards.double() ** 2).sum()),
        float(scores.correct.sum()),
        float(scores.lengths.sum()),
        float(gaps["total"].sum()),
        float(gaps["total"].numel()),
        float(gaps["numerics"].sum()),
        float(gaps["lag"].sum()),
        float(prepared.keep.sum()) / group_size,
        prepared.tokens,
        float(prepared.lag.sum()),
        float(rollouts.stale_dropped),
        float(sum(len(set(s.token_versions)) > 1 for s in rollouts.samples)),
    )
    return dict(zip(_TOTALS, summed))


def _sample_metrics(task_step: TaskStep, totals: dict[str, float], dp_max) -> dict[str, float]:
    """Rewards, accuracy, lengths, the trainer-rollout log-prob gap, kept groups, reward failures,
    trained tokens and skipped updates of the step."""
    prepared, counts = task_step.prepared, task_step.prepared.reward_counts
    n, gaps = counts.samples, prepared.gaps
    reward_mean = totals["reward_sum"] / max(n, 1.0)
    return {
        "reward_mean": reward_mean,
        "reward_std": max(totals["reward_sq"] / max(n, 1.0) - reward_mean**2, 0.0) ** 0.5,
        "accuracy": totals["correct"] / max(n, 1.0),
        "response_length": totals["length"] / max(n, 1.0),
        "logprob_abs_diff_mean": totals["gap"] / max(totals["gap_n"], 1.0),
        "logprob_abs_diff_max": dp_max(float(gaps["total"].max()) if gaps["total"].numel() else 0.0),
        "groups_kept": totals["kept_groups"],
        "reward_errors": counts.errors,
        "reward_timeouts": counts.timeouts,
        "reward_samples": n,
        "tokens": totals["tokens"],
        "adapter_version": float(task_step.task.version),
        "skipped_updates": task_step.skipped_updates,
    }


def _version_metrics(task_step: TaskStep, totals: dict[str, float], step_s: float, dp_max) -> dict[str, float]:
    """Version lag of the trained tokens, the log-prob gap split by cause, stale groups dropped and
    sampled again, and how long each side waited for the other."""
    task, rollouts, lag = task_step.task, task_step.rollouts, task_step.prepared.lag
    gap_n = max(totals["gap_n"], 1.0)
    if task.producer is not None:  # over the time since the previous step's rollouts were taken
        idle, elapsed = task.producer.idle_since_last()
    else:  # synchronously the rollout side waits while the trainer scores, trains and publishes
        idle, elapsed = step_s - rollouts.generate_s, step_s
    return {
        "version_lag_mean": totals["lag"] / gap_n,
        "version_lag_max": dp_max(float(lag.max()) if lag.numel() else 0.0),
        "logprob_gap_numerics": totals["numerics"] / gap_n,
        "logprob_gap_lag": totals["lag_gap"] / gap_n,
        "stale_samples_dropped": totals["stale"],
        "mixed_version_samples": totals["mixed"],  # rollout.update_policy='continue': samples an update landed in
        "trainer_idle_s": rollouts.wait_s,
        "rollout_idle_s": idle,
        "trainer_idle_fraction": rollouts.wait_s / step_s,
        "rollout_idle_fraction": min(max(idle, 0.0) / elapsed, 1.0) if elapsed > 0 else 0.0,
    }


def distill_metrics(task, prepared: Prepared, dp_sum) -> dict[str, float]:
    """With distillation: the mean log-prob gap log pi_student - log pi_teacher (the per-token
    reverse KL to the teacher on the student's samples) over the task's trained loss tokens on all
    ranks, `distill_logprob_gap`, and per data source (`distill_logprob_gap/<source>`, of the sources
    with tokens this step). Every rank sums the same list, its task's sources (those of its data)."""
    if not task.teachers:
        return {}
    sources = sorted(task.teachers)
    totals = dp_sum(*[value for source in sources for value in prepared.distill_gaps.get(source, (0.0, 0.0))])
    metrics = {}
    for source, total, count in zip(sources, totals[0::2], totals[1::2]):
        if count > 0:
            metrics[f"distill_logprob_gap/{source or NO_SOURCE}"] = total / count
    metrics["distill_logprob_gap"] = sum(totals[0::2]) / max(sum(totals[1::2]), 1.0)
    return metrics
